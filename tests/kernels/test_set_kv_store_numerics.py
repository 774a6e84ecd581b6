"""StoreNumerics: the set-KV stores with another writer's numerics (fp32 through norm and RoPE,
another fp8 maximum and amax floor, q rotated only), byte-exact between torch and Triton, and each
parameter checked against a plain restatement of what it means."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import hip_kernels  # noqa: E402
from hip_kernels import KernelOptions  # noqa: E402
from hip_kernels import kv_layout as L  # noqa: E402
from hip_kernels import numerics as N  # noqa: E402
from hip_kernels.backend import resolve  # noqa: E402
from hip_kernels.platform import DIALECTS, default_device  # noqa: E402
import v4_layout_encoder as E  # noqa: E402
from kv_inputs import (SENTINEL, clone_args, kv_cache, norm_rope_args, same_bytes,  # noqa: E402
                       to_device)
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

DEV = default_device()
HOST = N.StoreNumerics(round_to_bf16=False, q_mode="rope_only")
TORCH = KernelOptions(backend="torch")
VARIANTS = {
    "fp32 rows, q rope only": HOST,
    "fnuz max 224": N.StoreNumerics(round_to_bf16=False, fp8_max=224.0, q_mode="rope_only"),
    "q norm and rope in fp32": N.StoreNumerics(fp8_max=224.0, q_mode="norm_rope_fp32"),
    "amax floor 1e-8": N.StoreNumerics(amax_floor=1e-8),
}


def kernel_for(backend: str, dialect: str) -> KernelOptions:
    return KernelOptions(backend=backend, fp8_dialect=DIALECTS[dialect])


def run(backend, dialect, op, args, numerics):
    assert resolve(op, DEV, backend, hip_ok=numerics.is_default) == backend
    a = to_device(clone_args(args), DEV)
    getattr(hip_kernels, op)(**a, numerics=numerics, kernel=kernel_for(backend, dialect))
    return to_device(a, "cpu")


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dialect", ("fnuz", "ocp"))
def test_triton_matches_torch_with_host_numerics(name, dialect):
    numerics = VARIANTS[name]
    if numerics.fp8_max is not None and numerics.fp8_max > DIALECTS[dialect].max:
        pytest.skip("fp8_max above this dialect's maximum")
    args = norm_rope_args(seed=7, n=9, page_size=4, pages=4, heads=2)
    out = {b: run(b, dialect, "fused_k_norm_rope_store", args, numerics)
           for b in ("torch", "triton")}
    assert same_bytes(out["torch"]["cache"], out["triton"]["cache"])
    assert same_bytes(out["torch"]["q"], out["triton"]["q"])
    rows = args["kv"][:, :L.HEAD_DIM].contiguous()
    store = dict(rows=rows, cache=kv_cache(4, 4), out_loc=args["out_loc"], page_size=4)
    out = {b: run(b, dialect, "fused_store_cache", store, numerics)
           for b in ("torch", "triton")}
    assert same_bytes(out["torch"]["cache"], out["triton"]["cache"])


def test_unrounded_rows_are_quantized_from_fp32():
    """round_to_bf16=False: the quantized values are the fp32 norm output, not its bf16 rounding
    (on random rows some fp8 bytes must differ between the two)."""
    args = norm_rope_args(seed=3, n=16, page_size=16, pages=1)
    args["out_loc"] = torch.arange(16)
    loc = args["out_loc"]
    caches = {}
    for numerics in (N.DEFAULT_NUMERICS, HOST):
        a = clone_args(args)
        hip_kernels.fused_k_norm_rope_store(**a, numerics=numerics, kernel=TORCH)
        caches[numerics.round_to_bf16] = a["cache"]
    x = args["kv"][:, :L.HEAD_DIM].double()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * args["weight"].double()
    for rounded, cache in caches.items():
        got = L.read_kv_rows(cache, loc, 16, TORCH.fp8_dialect)[:, :L.NOPE_DIM]
        want = y[:, :L.NOPE_DIM]
        # e4m3 keeps 3 mantissa bits: within 2^-4 relative (plus bf16's 2^-8 when rounded first)
        bound = want.abs() * (2 ** -4 + 2 ** -8) + 1e-3
        assert ((got - want).abs() <= bound).all(), f"round_to_bf16={rounded}"
    values = {k: L.read_kv_bytes(c, loc, 16)[0][:, :L.NOPE_DIM] for k, c in caches.items()}
    assert (values[True] != values[False]).any()


@pytest.mark.parametrize("fp8_max, floor", [(224.0, 1e-4), (240.0, 1e-8)])
def test_fp8_max_and_amax_floor(fp8_max, floor):
    """Each tile's scale is 2^ceil(log2(max(amax, floor) / fp8_max)) and no value exceeds fp8_max
    (fnuz). A tile of tiny values shows the floor; a tile holding exactly fp8_max * 2^k shows
    the maximum."""
    numerics = N.StoreNumerics(fp8_max=fp8_max, amax_floor=floor)
    rows = torch.zeros(2, L.HEAD_DIM)
    rows[0, :64] = 1e-7                      # tile 0: amax below both floors
    rows[0, 64:128] = fp8_max * 4            # tile 1: exactly fp8_max * 2^2
    rows[1] = torch.linspace(-3, 3, L.HEAD_DIM)
    rows = rows.to(torch.bfloat16)
    nope, _, scales = L.quantize_kv_rows(rows, DIALECTS["fnuz"], numerics)
    amax = rows[:, :L.NOPE_DIM].float().view(2, 7, 64).abs().amax(-1).clamp_min(floor)
    want = torch.tensor([[math.ceil(math.log2(a / fp8_max)) + 127 for a in r.tolist()]
                         for r in amax.double()], dtype=torch.uint8)
    assert torch.equal(scales, want)
    assert nope.float().abs().max().item() <= fp8_max
    assert scales[0, 1].item() == 127 + 2                     # fp8_max * 4 -> scale 2^2
    assert nope[0, 64:128].float().eq(fp8_max).all()


def test_q_rope_only_rotates_the_tail_of_every_row():
    """q_rope_only: dims 0..447 of q untouched (no norm), dims 448..511 rotated with the
    fma rounding, also for rows whose location is negative (they write no KV)."""
    args = norm_rope_args(seed=11, n=6, page_size=4, pages=2, heads=3)
    args["out_loc"] = torch.tensor([0, -1, 5, -1, 7, 2])
    a = clone_args(args)
    hip_kernels.fused_k_norm_rope_store(**a, numerics=HOST, kernel=TORCH)
    q0, q1 = args["q"], a["q"]
    assert same_bytes(q1[..., :L.NOPE_DIM], q0[..., :L.NOPE_DIM])
    f = args["freqs_cis"][args["positions"].long()]
    c, s = f.real.unsqueeze(1).double(), f.imag.unsqueeze(1).double()
    x, y = q0[..., L.NOPE_DIM::2].double(), q0[..., L.NOPE_DIM + 1::2].double()
    re = (x * c + (-(y * s)).float().double()).float()
    im = (y * c + (x * s).float().double()).float()
    want = torch.stack([re, im], -1).flatten(-2).to(torch.bfloat16)
    assert same_bytes(q1[..., L.NOPE_DIM:], want)


def test_bad_numerics_are_refused_before_a_write():
    args = norm_rope_args(seed=1, n=2, page_size=4, pages=1)
    before = args["cache"].clone()
    with pytest.raises(ValueError, match="fp8_max=448.0 exceeds the fnuz fp8 maximum 240"):
        hip_kernels.fused_k_norm_rope_store(**args, numerics=N.StoreNumerics(fp8_max=448.0),
                                            kernel=kernel_for("torch", "fnuz"))
    with pytest.raises(TypeError, match="numerics must be a hip_kernels.StoreNumerics"):
        hip_kernels.fused_store_cache(args["kv"], args["cache"], args["out_loc"], 4, numerics={},
                                      kernel=TORCH)
    assert same_bytes(args["cache"], before)
    with pytest.raises(ValueError, match="amax_floor must be > 0"):
        N.StoreNumerics(amax_floor=0.0)


def test_hip_runs_only_what_it_covers(monkeypatch):
    """The HIP C++ kernels take the default numerics, a norm weight and a contiguous cache:
    other calls resolve to Triton."""
    import hip_kernels.backend as B
    from hip_kernels.set_kv import _hip_ok
    monkeypatch.setattr(B, "platform_backend", lambda: "rocm")
    monkeypatch.setattr(B, "hip_available", lambda: True)
    monkeypatch.setattr(B, "triton_usable", lambda device: True)
    gpu = torch.device("cuda")
    cache = kv_cache(2, 4)
    assert resolve("fused_k_norm_rope_store", gpu, "auto",
                   hip_ok=_hip_ok(N.DEFAULT_NUMERICS, cache)) == "hip"
    for ok in (_hip_ok(HOST, cache), _hip_ok(N.DEFAULT_NUMERICS, cache, has_weight=False),
               _hip_ok(N.DEFAULT_NUMERICS, strided_cache(2, 4, gap=576)[0])):
        assert not ok
        assert resolve("fused_k_norm_rope_store", gpu, "auto", hip_ok=ok) == "triton"
    assert resolve("fused_store_cache", gpu, "hip", hip_ok=False) == "triton"


def strided_cache(pages: int, page_size: int, gap: int, device="cpu"):
    """(view, base): a view of the page_size*584 used bytes of pages laid gap bytes further apart
    than page_bytes (as a host engine that interleaves layers in one block lays them), and the
    sentinel-filled tensor it views."""
    base = torch.full((pages, L.page_bytes(page_size) + gap), SENTINEL, dtype=torch.uint8,
                      device=device)
    return base[:, :page_size * L.TOKEN_BYTES], base


VLLM_LIKE = N.StoreNumerics(q_mode="norm_rope_fp32")


@pytest.mark.parametrize("dialect", ("fnuz", "ocp"))
def test_strided_pages_without_kv_norm(dialect):
    """weight=None (kv arrives normalized) into a cache whose pages are stride(0) bytes apart:
    Triton and torch agree byte for byte, every row lands where a contiguous cache has it, and
    the bytes between pages are never written."""
    args = norm_rope_args(seed=21, n=10, page_size=4, pages=4, heads=2)
    args["weight"] = None
    base, q = {}, {}
    for backend in ("torch", "triton"):
        view, pages = strided_cache(4, 4, gap=2 * 576, device=DEV)
        a = dict(to_device(clone_args(args), DEV), cache=view)
        hip_kernels.fused_k_norm_rope_store(**a, numerics=VLLM_LIKE,
                                            kernel=kernel_for(backend, dialect))
        base[backend], q[backend] = pages.cpu(), a["q"].cpu()
    assert same_bytes(base["torch"], base["triton"])
    assert same_bytes(q["torch"], q["triton"])
    assert (base["torch"][:, 4 * L.TOKEN_BYTES:] == SENTINEL).all()
    ref = run("torch", dialect, "fused_k_norm_rope_store", args, VLLM_LIKE)
    assert same_bytes(ref["cache"][:, :4 * L.TOKEN_BYTES], base["torch"][:, :4 * L.TOKEN_BYTES])


def test_no_kv_norm_stores_the_rotated_input():
    """weight=None: the stored row is kv itself with dims 448..511 rotated (fp32, one bf16
    rounding), quantized as the layout says (independent encoder, byte-exact)."""
    args = norm_rope_args(seed=4, n=5, page_size=8, pages=1)
    args.update(weight=None, out_loc=torch.tensor([0, 3, 7, -1, 5]))
    a = clone_args(args)
    hip_kernels.fused_k_norm_rope_store(**a, kernel=TORCH)
    f = args["freqs_cis"][args["positions"].long()]
    cos, sin = f.real.numpy(), f.imag.numpy()
    rows = args["kv"][:, :L.HEAD_DIM].float().numpy().copy()
    x, y = rows[:, 448::2].copy(), rows[:, 449::2].copy()
    rows[:, 448::2], rows[:, 449::2] = E.bf16(x * cos - y * sin), E.bf16(x * sin + y * cos)
    want = args["cache"].numpy().copy()
    E.encode_into(want, 8, [0, 3, 7, -1, 5], rows, torch.float8_e4m3fn, 448.0, 1e-4)
    assert (a["cache"].numpy() == want).all()


def test_q_norm_rope_fp32_rounds_once():
    """q_mode norm_rope_fp32: weightless RMSNorm and RoPE in fp32, one bf16 rounding (an
    independent numpy restatement, bit-exact); differs from the default's two roundings."""
    args = norm_rope_args(seed=9, n=6, page_size=4, pages=2, heads=3)
    outs = {}
    for numerics in (VLLM_LIKE, N.DEFAULT_NUMERICS):
        a = clone_args(args)
        hip_kernels.fused_k_norm_rope_store(**a, numerics=numerics, kernel=TORCH)
        outs[numerics.q_mode] = a["q"]
    q = args["q"].float().numpy()
    ss = (q.astype("float64") ** 2).sum(-1, keepdims=True)
    r = np.float32(1.0) / np.sqrt((ss / 512).astype(np.float32) + np.float32(1e-6))
    y = q * r
    f = args["freqs_cis"][args["positions"].long()]
    c, s_ = f.real.numpy()[:, None, :], f.imag.numpy()[:, None, :]
    a_, b_ = y[..., 448::2].copy(), y[..., 449::2].copy()
    y[..., 448::2], y[..., 449::2] = a_ * c - b_ * s_, a_ * s_ + b_ * c
    want = torch.from_numpy(y).to(torch.bfloat16)
    assert same_bytes(outs["norm_rope_fp32"], want)
    assert not same_bytes(outs["norm_rope"], want)


@pytest.mark.parametrize("dialect", ("fnuz", "ocp"))
def test_triton_follows_the_reference_numerics(dialect):
    """REFERENCE_NUMERICS (rms "device": fp32 mean of squares; q_mode "bf16_norm_rope": the q
    norm op by op in bf16): Triton writes the torch path's cache bytes on these rows (their fp32
    sums of squares come out the same in both orders) and q exactly as the op-by-op oracle;
    where torch's q differs, only torch's own CPU bf16 rsqrt / eps rounding explains it."""
    from reference_numerics_oracle import check_q

    args = norm_rope_args(seed=11, n=24, page_size=8, pages=4, heads=4)
    out = {b: run(b, dialect, "fused_k_norm_rope_store", args, N.REFERENCE_NUMERICS)
           for b in ("torch", "triton")}
    assert same_bytes(out["torch"]["cache"], out["triton"]["cache"])
    check_q(out["triton"]["q"], args, 64, out["torch"]["q"])
    default = run("triton", dialect, "fused_k_norm_rope_store", args,
                  N.DEFAULT_NUMERICS)
    assert not same_bytes(default["q"], out["triton"]["q"])   # the modes are told apart


def test_the_models_store_numerics_per_mode():
    assert N.store_numerics("reference") == N.REFERENCE_NUMERICS
    assert N.store_numerics("fp32") == N.DEFAULT_NUMERICS
    with pytest.raises(ValueError, match=r"numerics='bf16': expected one of reference\|fp32"):
        N.store_numerics("bf16")
