"""Triton set-KV kernels vs the torch reference, byte-exact over whole caches, both fp8 dialects.

Both backends run through the public `hip_kernels` ops (DSV4_KERNEL_BACKEND=torch|triton) on
copies of the same inputs. Caches start filled with a sentinel, and besides matching the reference
byte for byte, every byte outside the rows that should be written must still be the sentinel.
On a CPU the kernels run under Triton's interpreter with the conversion shim.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import hip_kernels  # noqa: E402
from hip_kernels import KernelOptions  # noqa: E402
from hip_kernels import kv_layout as L  # noqa: E402
from hip_kernels import numerics as N  # noqa: E402
from hip_kernels.backend import resolve  # noqa: E402
from hip_kernels import platform as P  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from kv_inputs import (SENTINEL, bf16_rows, clone_args, gen, indexer_cache, kv_cache,  # noqa: E402
                       locations, norm_rope_args, same_bytes, strided, to_device)
from set_kv_cases import every_bf16_case  # noqa: E402
from triton_interp_shim import interpreter_shim, unshimmed  # noqa: E402,F401 (autouse fixture)

DEV = default_device()
# fnuz fp8 is AMD's: Triton has no such type on an NVIDIA GPU (the interpreter and ROCm have)
DIALECTS = ("fnuz", "ocp") if DEV.type == "cpu" or torch.version.hip else ("ocp",)


def kernel_for(backend: str, dialect: str, **kw) -> KernelOptions:
    """The KernelOptions that run `backend` with caches in `dialect` ("fnuz" or "ocp")."""
    return KernelOptions(backend=backend, fp8_dialect=P.DIALECTS[dialect], **kw)


def run_backends(dialect, op, args):
    """{backend: the op's arguments after running it} for the torch and triton backends."""
    results = {}
    for backend in ("torch", "triton"):
        assert resolve(op, DEV, backend) == backend
        a = to_device(clone_args(args), DEV)
        getattr(hip_kernels, op)(**a, kernel=kernel_for(backend, dialect))
        results[backend] = to_device(a, "cpu")
    return results


def assert_same(results, *names):
    for name in names:
        t, r = results["triton"][name], results["torch"][name]
        if not same_bytes(t, r):
            diff = (t.view(torch.uint8) != r.view(torch.uint8)).nonzero()
            pytest.fail(f"{name}: {len(diff)} bytes differ, first at {diff[0].tolist()}")


def assert_only_rows_written(cache, loc, page_size, row_regions):
    """Every byte outside the regions of rows with loc >= 0 is still the sentinel."""
    outside = torch.ones(cache.numel(), dtype=torch.bool)
    for offsets, width in row_regions(loc[loc >= 0].long(), page_size):
        outside[(offsets[:, None] + torch.arange(width)).flatten()] = False
    flat = cache.view(-1)
    assert bool((flat[outside] == SENTINEL).all()), "bytes outside the written rows changed"


def kv_regions(loc, page_size):
    return [(L.value_offset(loc, page_size), L.VALUE_BYTES),
            (L.scale_offset(loc, page_size), L.SCALE_BYTES)]


def indexer_regions(loc, page_size):
    base = (loc // page_size) * L.indexer_page_bytes(page_size)
    t = loc % page_size
    return [(base + t * L.INDEX_DIM, L.INDEX_DIM), (base + page_size * L.INDEX_DIM + t * 4, 4)]


def pages_for(n, page_size):
    return max(2, -(-2 * n // page_size)) + 1


# (page_size, N, q heads, location dtype, weight dtype, stride of positions/out_loc):
# grids of at most 64 programs
NORM_ROPE_CASES = [
    (1, 1, 0, torch.int32, torch.bfloat16, 1),
    (2, 5, 3, torch.int64, torch.float32, 2),
    (64, 17, 2, torch.int32, torch.bfloat16, 1),
    (128, 33, 0, torch.int64, torch.float16, 3),
    (256, 64, 0, torch.int32, torch.bfloat16, 1),
]


def case_id(case):
    p, n, h, loc, w, stride = case
    return f"P{p}-N{n}-H{h}-{str(loc)[6:]}-w{str(w)[6:]}-s{stride}"


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("case", NORM_ROPE_CASES, ids=case_id)
def test_fused_k_norm_rope_store(dialect, case):
    page_size, n, heads, loc_dtype, weight_dtype, index_stride = case
    args = norm_rope_args(n * 7 + page_size, n, page_size, pages_for(n, page_size), heads,
                          loc_dtype, weight_dtype, index_stride)
    res = run_backends(dialect, "fused_k_norm_rope_store", args)
    assert_same(res, "cache", *(("q",) if heads else ()))
    assert_only_rows_written(res["triton"]["cache"], args["out_loc"], page_size, kv_regions)
    assert same_bytes(res["triton"]["kv"], args["kv"]), "kv was modified"


def translate_args(seed, n, page_size, map_dtype, with_out, index_stride):
    """full_loc into a full->SWA map with unmapped (0) entries and skipped (-1) rows; mapped rows
    target distinct SWA slots. Index tensors have element stride index_stride."""
    pages = pages_for(n, page_size)
    g = gen(seed)
    full_size = 3 * n + 5
    full_to_swa = torch.zeros(full_size, dtype=map_dtype)
    mapped = torch.randperm(full_size, generator=g)[: full_size // 2]
    full_to_swa[mapped] = (1 + torch.randperm(pages * page_size - 1, generator=g)[: len(mapped)]
                           ).to(map_dtype)
    args = norm_rope_args(seed, n, page_size, pages, index_stride=index_stride)
    del args["out_loc"]
    args["full_loc"] = strided(locations(g, n, full_size, torch.int64 if n % 2 else torch.int32,
                                         skip_every=3), index_stride)
    args["full_to_swa"] = strided(full_to_swa, index_stride)
    if with_out:
        args["swa_loc_out"] = strided(torch.full((n,), 12345, dtype=torch.int32), index_stride)
    return args


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("page_size,n,map_dtype,with_out,index_stride", [
    (64, 16, torch.int32, True, 1), (2, 9, torch.int64, False, 1), (1, 4, torch.int32, True, 2)])
def test_fused_translate_norm_rope_store(dialect, page_size, n, map_dtype, with_out,
                                         index_stride):
    args = translate_args(n + page_size, n, page_size, map_dtype, with_out, index_stride)
    res = run_backends(dialect, "fused_translate_norm_rope_store", args)
    assert_same(res, "cache", *(("swa_loc_out",) if with_out else ()))
    full = args["full_loc"].long()
    swa = torch.where(full >= 0, args["full_to_swa"][full.clamp_min(0)].long(), -1)
    assert (swa == 0).any() and (full < 0).any(), "the case must contain unmapped and skipped rows"
    written = torch.where(swa > 0, swa, -1)
    assert_only_rows_written(res["triton"]["cache"], written, page_size, kv_regions)
    if with_out:
        assert torch.equal(res["triton"]["swa_loc_out"], swa.to(torch.int32))


def fp8_tie_rows(n, g):
    """bf16 rows whose first tile is scaled to exactly 1 and holds values halfway between fp8
    neighbours (1 + 2^-4 sits between 1 and 1.125 in e4m3): round-to-nearest-even decides; plus
    -0.0 and a tiny negative that rounds to zero (fnuz has no -0: its 0x80 is NaN)."""
    rows = bf16_rows(g, n, L.HEAD_DIM)
    k = torch.arange(32, dtype=torch.float32)
    ties = (1 + (2 * (k % 8) + 1) / 16) * 2.0 ** (k // 8 - 3)     # 1.0625, 1.1875, ... in 4 binades
    tile = torch.cat([ties, -ties]).to(torch.bfloat16)
    rows[:, :64] = tile
    rows[:, 0] = 240                                               # amax 240: scale 1 (both)
    rows[:, 1] = -0.0
    rows[:, 2] = -2.0 ** -12
    return rows


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("page_size,n", [(1, 3), (2, 8), (64, 24), (128, 40), (256, 64)])
def test_fused_store_cache(dialect, page_size, n):
    g = gen(page_size + n)
    args = dict(rows=fp8_tie_rows(n, g), cache=kv_cache(pages_for(n, page_size), page_size),
                out_loc=locations(g, n, pages_for(n, page_size) * page_size,
                                  torch.int32 if n % 2 else torch.int64),
                page_size=page_size)
    res = run_backends(dialect, "fused_store_cache", args)
    assert_same(res, "cache")
    assert_only_rows_written(res["triton"]["cache"], args["out_loc"], page_size, kv_regions)


@pytest.mark.skipif(DEV.type != "cpu", reason="the interpreter's own casts")
@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("op", ["fused_store_cache", "indexer_store"])
def test_fp8_rounding_does_not_depend_on_the_interpreters_cast(dialect, op):
    """Every bf16 value the fp8 conversion can see (ties, subnormals, -0), and indexer keys,
    store torch's bytes under the interpreter as Triton ships it (it rounds halves up)."""
    if op == "fused_store_cache":
        args, _ = every_bf16_case(hip_kernels.platform.DIALECTS[dialect])
    else:
        g = gen(9)
        args = dict(k=fp8_tie_rows(24, g)[:, :L.INDEX_DIM].contiguous(),
                    cache=indexer_cache(1, 64), out_loc=locations(g, 24, 64), page_size=64)
    with unshimmed():
        assert_same(run_backends(dialect, op, args), "cache")


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("page_size,n", [(1, 3), (64, 12), (256, 33)])
def test_store_kv_pack(dialect, page_size, n):
    g = gen(n)
    nope, rope, scales = L.quantize_kv_rows(bf16_rows(g, n, L.HEAD_DIM), P.DIALECTS[dialect])
    pages = pages_for(n, page_size)
    wide_nope = torch.zeros(n, L.NOPE_DIM + 64, dtype=torch.uint8)
    wide_nope[:, 16:16 + L.NOPE_DIM] = nope.view(torch.uint8)
    args = dict(nope_fp8=wide_nope[:, 16:16 + L.NOPE_DIM].view(nope.dtype), rope_bf16=rope,
                scales=scales, cache=kv_cache(pages, page_size),
                out_loc=locations(g, n, pages * page_size), page_size=page_size)
    res = run_backends(dialect, "store_kv_pack", args)
    assert_same(res, "cache")
    assert_only_rows_written(res["triton"]["cache"], args["out_loc"], page_size, kv_regions)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("page_size,n,dtype", [
    (1, 3, torch.float32), (64, 20, torch.bfloat16), (256, 7, torch.float16)])
def test_indexer_store(dialect, page_size, n, dtype):
    g = gen(n)
    pages = pages_for(n, page_size)
    args = dict(k=bf16_rows(g, n, L.INDEX_DIM, pad=32).to(dtype),
                cache=indexer_cache(pages, page_size),
                out_loc=locations(g, n, pages * page_size, torch.int32), page_size=page_size)
    res = run_backends(dialect, "indexer_store", args)
    assert_same(res, "cache")
    assert_only_rows_written(res["triton"]["cache"], args["out_loc"], page_size, indexer_regions)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_all_rows_skipped_write_nothing(dialect):
    triton = kernel_for("triton", dialect)
    args = norm_rope_args(3, 6, 64, 2, heads=1)
    args["out_loc"][:] = -1
    a = to_device(clone_args(args), DEV)
    hip_kernels.fused_k_norm_rope_store(**a, kernel=triton)
    assert bool((a["cache"] == SENTINEL).all())
    assert not same_bytes(a["q"].cpu(), args["q"]), "q is normalized even for skipped rows"
    rows = bf16_rows(gen(1), 6, L.HEAD_DIM).to(DEV)
    skip = torch.full((6,), -1, device=DEV)
    cache, icache = kv_cache(2, 64).to(DEV), indexer_cache(2, 64).to(DEV)
    hip_kernels.fused_store_cache(rows, cache, skip, 64, kernel=triton)
    hip_kernels.indexer_store(rows[:, :L.INDEX_DIM].contiguous(), icache, skip, 64,
                              kernel=triton)
    assert bool((cache == SENTINEL).all()) and bool((icache == SENTINEL).all())


@pytest.mark.parametrize("dialect", DIALECTS)
def test_empty_batch(dialect):
    args = norm_rope_args(0, 1, 1, 2, heads=1)
    args = {k: v[:0] if isinstance(v, torch.Tensor) and k not in ("cache", "weight", "freqs_cis")
            else v for k, v in args.items()}
    res = run_backends(dialect, "fused_k_norm_rope_store", args)
    assert bool((res["triton"]["cache"] == SENTINEL).all())


@pytest.mark.skipif(DEV.type != "cpu", reason="CPU dispatch")
def test_triton_backend_on_cpu_needs_the_interpreter():
    assert resolve("fused_store_cache", DEV, "triton") == "triton"   # TRITON_INTERPRET=1 here
    assert resolve("fused_store_cache", DEV, "auto") == "torch"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch, hip_kernels as hk\n"
            "try:\n    hk.fused_store_cache(torch.zeros(1, 512, dtype=torch.bfloat16),"
            " torch.zeros(1, 1152, dtype=torch.uint8), torch.tensor([0]), 1,"
            " kernel=hk.KernelOptions(backend='triton'))\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "BackendUnavailable" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out


@pytest.mark.parametrize("op", ["fused_k_norm_rope_store", "fused_store_cache",
                                "fused_translate_norm_rope_store"])
def test_slots_past_the_cache_are_masked_in_the_kernel(op):
    """value_checks=False: nothing checks the slots on the host, and a slot past the
    cache (or a full location past the map) still writes nothing, in Triton as in torch."""
    from set_kv_cases import make_case

    args = make_case(op, 3, 6, 4, 2, 0, torch.int64, torch.bfloat16)
    # the cache is the first 2 of 3 pages: an unmasked write to slot 8 would land in the third
    base = torch.full((3, L.page_bytes(4)), 0x5A, dtype=torch.uint8, device=DEV)
    args["cache"] = base[:2]
    if op == "fused_translate_norm_rope_store":
        args["full_to_swa"][args["full_loc"][0]] = 8
        args["full_loc"][1] = len(args["full_to_swa"]) + 5
    else:
        args["out_loc"][0], args["out_loc"][1] = 8, 1 << 40
    results = {}
    for backend in ("torch", "triton"):
        base[:] = 0x5A
        a = dict(to_device(clone_args(args), DEV), cache=base[:2])
        getattr(hip_kernels, op)(**a, kernel=kernel_for(backend, DIALECTS[0], value_checks=False))
        assert (base[2] == 0x5A).all(), f"{backend} wrote past the cache"
        results[backend] = dict(to_device(a, "cpu"), cache=base[:2].clone().cpu())
    assert_same(results, *[k for k in ("cache", "swa_loc_out") if k in args])
    assert not (results["torch"]["cache"] == 0x5A).all(), "the in-range rows were not written"


@pytest.mark.parametrize("dialect", DIALECTS)
def test_indexer_store_with_power_of_two_scales_reads_fp4_keys_back_exactly(dialect):
    """pow2_scale=True (the model's indexer keys): FP4-simulated keys, e2m1 values times a
    power of two per 32-wide block, spanning 2^-20..2^20, are read back bit for bit, torch and
    Triton write the same bytes, and every stored scale is a power of two. The default scale
    (amax / FP8_MAX) loses some of them."""
    from hip_kernels.activation_sim import fp4_quant_dequant

    g = gen(9)
    n, page_size = 24, 16
    k = torch.randn(n, L.INDEX_DIM, generator=g) * 2.0 ** torch.randint(-20, 21, (n, 1),
                                                                         generator=g)
    k = fp4_quant_dequant(k.to(torch.bfloat16))
    loc = torch.randperm(2 * page_size, generator=g)[:n]
    args = dict(k=k, cache=indexer_cache(2, page_size), out_loc=loc, page_size=page_size,
                pow2_scale=True)
    res = run_backends(dialect, "indexer_store", args)
    assert_same(res, "cache")
    cache = res["triton"]["cache"]
    got = L.read_indexer_rows(cache, loc, page_size, P.DIALECTS[dialect])
    assert torch.equal(got, k.float())
    base = (loc // page_size) * L.indexer_page_bytes(page_size) + page_size * L.INDEX_DIM
    at = (base + loc % page_size * 4)[:, None] + torch.arange(4)
    scale = cache.view(-1)[at].contiguous().view(torch.float32).flatten()
    assert torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))
    plain = to_device(clone_args({**args, "pow2_scale": False}), DEV)
    hip_kernels.indexer_store(**plain, kernel=kernel_for("auto", dialect))
    lossy = L.read_indexer_rows(plain["cache"].cpu(), loc, page_size, P.DIALECTS[dialect])
    assert not torch.equal(lossy, k.float())


@pytest.mark.parametrize("numerics", [N.DEFAULT_NUMERICS, N.REFERENCE_NUMERICS],
                         ids=["default", "reference"])
def test_translate_with_q_stores_what_the_plain_store_does(numerics):
    """The translating op with q and numerics: Triton writes the bytes and the q that its plain
    store writes at the translated slots; with the default numerics the torch reference too."""
    args = translate_args(5, 9, 2, torch.int64, True, 1)
    args["q"] = norm_rope_args(6, 9, 2, 1, heads=3)["q"]
    full = args["full_loc"].long()
    swa = torch.where(full >= 0, args["full_to_swa"][full.clamp_min(0)].long(), -1)
    plain = clone_args(args)
    for k in ("full_loc", "full_to_swa", "swa_loc_out"):
        del plain[k]
    plain["out_loc"] = torch.where(swa > 0, swa, -1)
    got, want = {}, {}
    for backend in ("torch", "triton"):
        kernel = KernelOptions(backend=backend)
        a, p = to_device(clone_args(args), DEV), to_device(clone_args(plain), DEV)
        hip_kernels.fused_translate_norm_rope_store(**a, numerics=numerics, kernel=kernel)
        hip_kernels.fused_k_norm_rope_store(**p, numerics=numerics, kernel=kernel)
        got[backend], want[backend] = to_device(a, "cpu"), to_device(p, "cpu")
        for name in ("cache", "q"):
            assert same_bytes(got[backend][name], want[backend][name]), (backend, name)
        assert not same_bytes(got[backend]["q"], args["q"]), "q was not touched"
    if numerics == N.DEFAULT_NUMERICS:
        for name in ("cache", "q", "swa_loc_out"):
            assert same_bytes(got["triton"][name], got["torch"][name]), name
