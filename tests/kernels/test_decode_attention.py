"""The sparse attention over the paged FP8 caches as one dispatcher op: the Triton kernel (on a
GPU, or interpreted here) against the torch path in both numerics, invalid and poisoned rows,
one op per call, argument checks, and the torch path against the model's extend-path math.

Caches are written by the real store op (`set_kv.fused_store_cache`). Tolerance: both backends
compute in fp32 from the same exactly dequantized rows; they differ in the order of the sums
(q . row over 512 products, the softmax denominator, p . rows) and, in reference numerics, a
probability rounded to bf16 in one backend can round the other way when its fp32 value differs
in the last bits. The outputs are bf16, so they are compared to 2 bf16 ulps of the output's
scale (rtol 2^-7, atol 2^-7 times the largest |o| of the case), and the worst fp32 error is
printed on failure.
"""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import KernelOptions, kv_layout as L, set_kv  # noqa: E402
from hip_kernels import decode_attention as A  # noqa: E402
from hip_kernels.platform import DIALECTS, default_device  # noqa: E402
from op_recorder import op_names  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

DEV = default_device()
# Every cache of a test is written and read in DIALECT.
DIALECT = DIALECTS["fnuz" if DEV.type == "cpu" or torch.version.hip else "ocp"]
SWA_PAGE, CMP_PAGE = 16, 4


def kernel_options(backend: str = "auto") -> KernelOptions:
    return KernelOptions(backend=backend, fp8_dialect=DIALECT)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def filled_cache(g, slots, page_size):
    """A V4 cache with a stored row in every slot (rows of mixed magnitude)."""
    rows = torch.randn(slots, L.HEAD_DIM, generator=g) * 10 ** (
        torch.rand(slots, 1, generator=g) - 0.5)
    cache = torch.zeros(slots // page_size, L.page_bytes(page_size), dtype=torch.uint8)
    set_kv.fused_store_cache(rows.bfloat16(), cache, torch.arange(slots), page_size,
                             kernel=kernel_options())
    return cache


def case(seed, n, heads, window, comp, slots=96):
    """Arguments of sparse_decode_attention: decode-like windows (an invalid prefix of
    `window - pos - 1` rows for small positions), compressed rows with some invalid."""
    g = gen(seed)
    swa = filled_cache(g, slots, SWA_PAGE)
    q = (torch.randn(n, heads, L.HEAD_DIM, generator=g) * 2).bfloat16()
    pos = torch.randint(0, 2 * window, (n,), generator=g)
    window_valid = (pos[:, None] - torch.arange(window - 1, -1, -1)) >= 0
    window_loc = torch.where(window_valid, torch.randint(0, slots, (n, window), generator=g), 0)
    sink = torch.randn(heads, generator=g)
    args = dict(q=q, swa_cache=swa, window_loc=window_loc, window_valid=window_valid,
                swa_page_size=SWA_PAGE, comp_cache=None, comp_loc=None, comp_valid=None,
                comp_page_size=CMP_PAGE, sink=sink, scale=L.HEAD_DIM ** -0.5)
    if comp is not None:
        cmp_cache = filled_cache(g, 64, CMP_PAGE)
        comp_valid = torch.rand(n, comp, generator=g) > 0.25
        comp_loc = torch.where(comp_valid, torch.randint(0, 64, (n, comp), generator=g), 0)
        args.update(comp_cache=cmp_cache, comp_loc=comp_loc, comp_valid=comp_valid)
    return args


def on(args, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def both_backends(args, reference):
    out = {}
    for backend in ("torch", "triton"):
        out[backend] = A.sparse_decode_attention(**on(args, DEV), reference=reference,
                                                 kernel=kernel_options(backend)).cpu()
    return out["torch"], out["triton"]


def assert_close(got, want):
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * scale), (
        f"max |diff| {err} at output scale {scale}")


@pytest.mark.parametrize("reference", [False, True], ids=["fp32", "reference"])
@pytest.mark.parametrize("n,heads,window,comp", [
    (1, 4, 8, None), (3, 4, 8, 5), (2, 16, 128, 70), (2, 20, 16, 3), (1, 64, 128, 70)])
def test_triton_matches_torch(reference, n, heads, window, comp):
    args = case(n * 7 + heads + window, n, heads, window, comp)
    want, got = both_backends(args, reference)
    assert got.dtype == torch.bfloat16 and got.shape == (n, heads, L.HEAD_DIM)
    assert bool(torch.isfinite(got).all())
    assert_close(got, want)


def test_the_kernel_walks_the_valid_window_rows_first():
    """Reference numerics: the kernel walks a query's valid window rows first, each in its column
    order (the reference's order: the 64-row blocks hold the reference's rows), with no sorted
    copy made before it. Invalid rows scattered through the window give the bits of the same rows
    sorted valid-first beforehand, and match the torch path."""
    args = case(31, 3, 16, 128, 70)
    holes = torch.rand(args["window_valid"].shape, generator=gen(32)) < 0.4
    holes[:, -1] = False                                    # each query's own slot stays valid
    valid = args["window_valid"] & ~holes
    args.update(window_valid=valid, window_loc=torch.where(valid, args["window_loc"], 0))
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    sorted_args = dict(args, window_loc=args["window_loc"].gather(1, order),
                       window_valid=valid.gather(1, order))
    triton = kernel_options("triton")
    got = A.sparse_decode_attention(**on(args, DEV), reference=True, kernel=triton).cpu()
    want = A.sparse_decode_attention(**on(sorted_args, DEV), reference=True, kernel=triton).cpu()
    assert torch.equal(got, want)
    assert_close(got, A.sparse_decode_attention(**args, reference=True,
                                                kernel=kernel_options("torch")))


def test_the_numerics_modes_differ():
    """The reference rounding is really applied (the modes are not the same computation)."""
    args = case(5, 2, 16, 128, 70)
    triton = kernel_options("triton")
    ref = A.sparse_decode_attention(**on(args, DEV), reference=True, kernel=triton).cpu()
    f32 = A.sparse_decode_attention(**on(args, DEV), reference=False, kernel=triton).cpu()
    assert not torch.equal(ref, f32)


@pytest.mark.parametrize("reference", [False, True], ids=["fp32", "reference"])
def test_invalid_rows_read_nothing(reference):
    """Poisoned bytes (NaN values, NaN scales) at the slots of invalid rows, and an invalid row
    pointing past the cache, change nothing in either backend."""
    args = case(11, 2, 4, 16, 6)
    clean = both_backends(args, reference)
    bad = dict(args, swa_cache=args["swa_cache"].clone(), comp_cache=args["comp_cache"].clone())
    for cache, loc, ok, page in ((bad["swa_cache"], args["window_loc"], args["window_valid"],
                                  SWA_PAGE),
                                 (bad["comp_cache"], args["comp_loc"], args["comp_valid"],
                                  CMP_PAGE)):
        used = set(loc[ok].tolist())
        spare = [s for s in range(cache.shape[0] * page) if s not in used][0]
        cache.view(-1)[L.value_offset(torch.tensor([spare]), page)[0]:][:L.VALUE_BYTES] = 0xFF
        loc[~ok] = spare
    bad["comp_loc"] = torch.where(args["comp_valid"], args["comp_loc"], 10 ** 6)
    assert (~args["window_valid"]).any() and (~args["comp_valid"]).any()
    for got, want in zip(both_backends(bad, reference), clean):
        assert torch.equal(got, want)


@pytest.mark.parametrize("reference", [False, True], ids=["fp32", "reference"])
def test_invalid_compressed_rows_after_the_valid_ones_change_no_bit(reference):
    """A captured graph's compressed segment is wider than eager's (its static width); the
    extra rows are invalid. The torch path gives the same bits whatever their number. (fp32:
    torch's softmax, which sums in an order set by the row's length, changed the output in 2
    of these 40 cases with torch's AVX512 kernels, 5 with its AVX2 ones, 2 with its plain ones.)
    """
    g = gen(21)
    n, heads, window = 2, 4, 128
    for i in range(40):
        comp, extra = (int(torch.randint(1, hi, (), generator=g)) for hi in (40, 80))
        q = torch.randn(n, heads, L.HEAD_DIM, generator=g).bfloat16()
        rows = [torch.randn(n, k, L.HEAD_DIM, generator=g).bfloat16()
                for k in (window, comp + extra)]
        valid = [torch.rand(n, window, generator=g) > 0.1,
                 torch.arange(comp + extra) < torch.randint(1, comp + 1, (n, 1), generator=g)]
        sink = torch.randn(heads, generator=g)
        want = A.sparse_attention_rows(q, [rows[0], rows[1][:, :comp]],
                                       [valid[0], valid[1][:, :comp]], sink, 0.05, reference)
        got = A.sparse_attention_rows(q, rows, valid, sink, 0.05, reference)
        assert torch.equal(got, want), (i, comp, extra)


def test_the_torch_path_is_the_models_math():
    """The op's torch path = read_kv_rows + sparse_attention_rows, what the model's extend path
    runs on the same rows (Attention.sparse_attention), bit for bit in both modes."""
    from dsv4.config import ModelConfig
    from dsv4.layers.attention import Attention

    cfg = ModelConfig.preset("tiny")
    attn = Attention(cfg, 1)
    args = case(3, 3, cfg.n_heads, 128, 9)
    with torch.no_grad():
        attn.attn_sink.copy_(args["sink"])
    kv = [L.read_kv_rows(args["swa_cache"], args["window_loc"], SWA_PAGE, DIALECT),
          L.read_kv_rows(args["comp_cache"], args["comp_loc"], CMP_PAGE, DIALECT)]
    valid = [args["window_valid"], args["comp_valid"]]
    for mode in ("fp32", "reference"):
        want = attn.sparse_attention(args["q"], kv, valid, mode == "reference")
        got = A.sparse_decode_attention(**dict(args, scale=attn.softmax_scale),
                                        reference=mode == "reference",
                                        kernel=kernel_options("torch"))
        assert torch.equal(got, want), mode


def test_one_dispatcher_op_per_call():
    args = case(2, 2, 4, 8, 5)
    assert op_names(lambda: A.sparse_decode_attention(**args, reference=True,
                                                      kernel=kernel_options())) == [
        "dsv4::sparse_decode_attention"]


def test_the_meta_implementation_gives_the_shape():
    """(the fake implementation: graph capture and torch.compile see the output's shape)"""
    args = on(case(2, 2, 4, 8, 5), "meta")
    out = A.sparse_decode_attention(**args, reference=False)
    assert out.shape == (2, 4, L.HEAD_DIM) and out.device.type == "meta"


@pytest.mark.parametrize("change,error,match", [
    (dict(q=torch.zeros(2, 4, 500, dtype=torch.bfloat16)), ValueError,
     r"q must have shape \[\*, \*, 512\]"),
    (dict(q=torch.zeros(2, 4, 512, dtype=torch.float16)), TypeError,
     "q must have dtype torch.bfloat16 or torch.float32"),
    (dict(window_loc=torch.zeros(3, 8, dtype=torch.int64)), ValueError,
     r"window_loc must have shape \[2, \*\]"),
    (dict(window_valid=torch.ones(2, 7, dtype=torch.bool)), ValueError,
     r"window_valid must have shape \[2, 8\]"),
    (dict(window_valid=torch.ones(2, 8, dtype=torch.uint8)), TypeError,
     "window_valid must have dtype torch.bool"),
    (dict(sink=torch.zeros(5)), ValueError, r"sink must have shape \[4\]"),
    (dict(sink=torch.zeros(4, dtype=torch.bfloat16)), TypeError,
     "sink must have dtype torch.float32"),
    (dict(swa_page_size=0), ValueError, "swa_page_size must be an int >= 1"),
    (dict(swa_cache=torch.zeros(2, 10, dtype=torch.uint8)), ValueError,
     "swa_cache page stride is 10 bytes but page_size=16 needs"),
    (dict(swa_cache=torch.zeros(2, 10)), TypeError, "swa_cache must have dtype torch.uint8"),
    (dict(comp_cache=None), ValueError, "comp_loc and comp_valid need comp_cache"),
    (dict(comp_valid=torch.ones(2, 4, dtype=torch.bool)), ValueError,
     r"comp_valid must have shape \[2, 5\]"),
    (dict(comp_loc=torch.zeros(3, 5, dtype=torch.int64)), ValueError,
     r"comp_loc must have shape \[2, \*\]"),
    # every index tensor on q's device (meta stands for another device here)
    *[(dict(on({name: case(2, 2, 4, 8, 5)[name]}, "meta")), ValueError,
       f"{name} must be on cpu, got meta")
      for name in ("window_loc", "window_valid", "comp_loc", "comp_valid")],
])
def test_bad_arguments_are_named(change, error, match):
    """(before any kernel runs)"""
    args = dict(case(2, 2, 4, 8, 5), **change)
    with pytest.raises(error, match=match):
        A.sparse_decode_attention(**args, reference=False)
    with pytest.raises(TypeError, match="reference must be a bool"):
        A.sparse_decode_attention(**case(2, 2, 4, 8, 5), reference=1)
    with pytest.raises(TypeError, match="kernel must be a hip_kernels.KernelOptions, got str"):
        A.sparse_decode_attention(**case(2, 2, 4, 8, 5), reference=False, kernel="triton")


def test_a_narrow_window_puts_the_compressed_rows_after_its_width():
    """window_width (an extend's prefill from position 0 with L < window tokens): the reference
    walks the window's first min(L, window) columns (valid rows first), then the compressed rows.
    Each row gives the bits of that row alone with its window cut to its width, and not those of
    the full window (the compressed rows would land in a later 64-row block)."""
    g = gen(12)
    n, heads, window, comp = 3, 4, 128, 8
    q = torch.randn(n, heads, L.HEAD_DIM, generator=g).bfloat16()
    rows = [torch.randn(n, k, L.HEAD_DIM, generator=g).bfloat16().float() for k in (window, comp)]
    rows[1] = (rows[1] + q[:, :1].float()).bfloat16().float()   # they raise the running max
    pos = torch.tensor([0, 17, 39])
    window_valid = (pos[:, None] - torch.arange(window - 1, -1, -1)) >= 0     # oldest first
    comp_valid = torch.arange(comp) < (pos[:, None] + 1) // 4
    width = torch.tensor([40, 40, 40]) - torch.tensor([0, 5, 0])
    sink = torch.randn(heads, generator=g)
    got = A.sparse_attention_rows(q, rows, [window_valid, comp_valid], sink, 0.04, True, width)
    full = A.sparse_attention_rows(q, rows, [window_valid, comp_valid], sink, 0.04, True)
    assert not torch.equal(got, full)
    for i, w in enumerate(width.tolist()):
        order = torch.argsort((~window_valid[i]).to(torch.int8), stable=True)[:w]
        alone = A.sparse_attention_rows(q[i:i + 1], [rows[0][i:i + 1, order], rows[1][i:i + 1]],
                                        [window_valid[i:i + 1, order], comp_valid[i:i + 1]],
                                        sink, 0.04, True)
        assert torch.equal(got[i], alone[0]), i
