"""The lightning indexer's scores read from the FP8 indexer cache as one dispatcher op: the
Triton kernel (under the interpreter, with the conversion shim) against the torch path in both
numerics and both fp8 dialects, -inf for invalid rows, poisoned keys, offsets past 4 GiB, one
op per call, the backend choice, argument checks, and the reference against the formula.

Caches are written by the real store op (`set_kv.indexer_store`, the model's power-of-two
scales). fp32 numerics: the two backends sum in different orders, so they agree to fp32
rounding. bf16 numerics: each q.k is a sum of 128 exact products taken in fp32 in a different
order than torch's CPU bf16 matmul, so one near a bf16 rounding boundary can round the other
way: the scores then differ by one bf16 ulp of a head's term (plus the final rounding); all but
a handful of entries are bit-equal.
"""

import mmap

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import KernelOptions, set_kv  # noqa: E402
from hip_kernels import kv_layout as L  # noqa: E402
from hip_kernels.indexer_scores import (KEY_TILE_COLUMNS, indexer_scores,  # noqa: E402
                                        indexer_scores_shared,
                                        indexer_scores_ref)
from hip_kernels.backend import BackendUnavailable  # noqa: E402
from hip_kernels import platform as P  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from hip_kernels.library import op  # noqa: E402
from op_recorder import backends, recorded_calls  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

PAGE = 16
PAGES = 9
SLOTS = PAGE * PAGES
DIALECTS = ("fnuz", "ocp")
DEV = default_device()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def kernel_for(dialect: str, backend: str = "auto") -> KernelOptions:
    """The KernelOptions of a cache in `dialect` ("fnuz" or "ocp")."""
    return KernelOptions(backend=backend, fp8_dialect=P.DIALECTS[dialect])


def filled_cache(g, pow2_scale=True, slots=SLOTS, dialect="ocp"):
    """An indexer cache with a stored key in every slot (keys of mixed magnitude)."""
    k = torch.randn(slots, L.INDEX_DIM, generator=g) * 10 ** (torch.rand(slots, 1, generator=g)
                                                              - 1)
    cache = torch.zeros(slots // PAGE, L.indexer_page_bytes(PAGE), dtype=torch.uint8)
    set_kv.indexer_store(k.to(torch.bfloat16), cache, torch.arange(slots), PAGE,
                         pow2_scale=pow2_scale, kernel=kernel_for(dialect))
    return cache


def queries(g, n, heads, c, q_dtype=torch.bfloat16, w_dtype=torch.bfloat16, slots=SLOTS):
    """(q, weights, loc, valid): locations across every page, about 1 in 5 rows invalid (loc 0),
    weights of either sign scaled as the model's (128^-0.5 * Hi^-0.5)."""
    q = torch.randn(n, heads, L.INDEX_DIM, generator=g).to(q_dtype)
    w = (torch.randn(n, heads, generator=g) * (L.INDEX_DIM * heads) ** -0.5).to(w_dtype)
    valid = torch.rand(n, c, generator=g) > 0.2
    loc = torch.where(valid, torch.randint(0, slots, (n, c), generator=g), 0)
    return q, w, loc, valid


def both_backends(dialect, *args):
    """(torch, triton) scores, on CPU, of the same arguments run on the test device (the GPU
    where there is one: Triton compiled for it; else the CPU: Triton interpreted)."""
    if DEV.type == "cuda" and dialect == "fnuz" and torch.version.hip is None:
        pytest.skip("fnuz fp8 is AMD's dialect: Triton has no such type on an NVIDIA GPU")
    args = tuple(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args)
    out = {}
    for backend in ("torch", "triton"):
        used, scores = run_recorded(*args, kernel=kernel_for(dialect, backend))
        assert used == backend
        out[backend] = scores.cpu()
    return out["torch"], out["triton"]


def run_recorded(*args, **kwargs) -> tuple:
    """(the backend that ran the op, the scores) of indexer_scores(*args, **kwargs)."""
    out = []
    (backend,) = backends(lambda: out.append(indexer_scores(*args, **kwargs)),
                          "dsv4::indexer_scores")
    return backend, out[0]


def bf16_ulp(x):
    """One bf16 ulp of fp32 |x| (0 for 0)."""
    m, e = torch.frexp(x.abs())
    return torch.where(m == 0, 0.0, torch.ldexp(torch.ones_like(m), e - 8))


def assert_bf16_close(got, want, q, w, keys, valid):
    """Equal but for a few entries, each within one bf16 ulp of the score plus two of the
    largest head term (one q.k rounded the other way, carried through the weighting)."""
    terms = torch.einsum("nhd,ntd->nht", q.bfloat16().float(), keys.bfloat16().float()).relu()
    term_max = (terms * w.float().unsqueeze(-1)).abs().amax(1)
    g, r = got.float()[valid], want.float()[valid]
    bound = bf16_ulp(r) + 2 * bf16_ulp(term_max[valid])
    assert bool(((g - r).abs() <= bound).all()), (g - r).abs().max()
    assert int((g != r).sum()) <= max(2, r.numel() // 100)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [8, 64])
@pytest.mark.parametrize("n, c", [(1, 1), (3, 7), (2, 200)])
def test_triton_matches_torch(dialect, w_dtype, heads, n, c):
    g = gen(DIALECTS.index(dialect) * 1000 + heads * 10 + c + (w_dtype == torch.bfloat16))
    cache = filled_cache(g, dialect=dialect)
    q_dtype = torch.float32 if c == 7 else torch.bfloat16
    q, w, loc, valid = queries(g, n, heads, c, q_dtype, w_dtype)
    want, got = both_backends(dialect, q, w, cache, loc, valid, PAGE)
    assert got.dtype == want.dtype == w_dtype and got.shape == want.shape == (n, c)
    assert bool(torch.isneginf(want[~valid]).all()) and bool(torch.isneginf(got[~valid]).all())
    assert bool(torch.isfinite(want[valid]).all())
    if w_dtype == torch.float32:
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-6)
    else:
        keys = L.read_indexer_rows(cache, loc, PAGE, P.DIALECTS[dialect])
        assert_bf16_close(got, want, q, w, keys, valid)


def test_bf16_rounding_differences_stay_within_the_tolerance():
    """fp32 queries and amax / FP8_MAX scales (more mantissa bits than the model's keys) make
    q.k sums that are not exact in fp32: the tolerance still holds."""
    g = gen(7)
    cache = filled_cache(g, pow2_scale=False)
    q, w, loc, valid = queries(g, 4, 64, 200, q_dtype=torch.float32)
    want, got = both_backends("ocp", q, w, cache, loc, valid, PAGE)
    keys = L.read_indexer_rows(cache, loc, PAGE, P.OCP)
    assert_bf16_close(got, want, q, w, keys, valid)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_a_poisoned_key_scores_nan_where_valid_and_never_leaks(w_dtype):
    g = gen(11)
    cache = filled_cache(g, dialect="fnuz")
    bad = torch.full((1, L.INDEX_DIM), 1.0)
    bad[0, 5] = float("nan")
    set_kv.indexer_store(bad.bfloat16(), cache, torch.tensor([37]), PAGE, pow2_scale=True,
                         kernel=kernel_for("fnuz"))
    q, w, loc, valid = queries(g, 2, 8, 9, w_dtype=w_dtype)
    loc[:, :3] = 37
    valid[0, :3] = False         # query 0: the poisoned slot at invalid rows
    valid[1, :3] = True          # query 1: the same slot at valid rows
    for out in both_backends("fnuz", q, w, cache, loc, valid, PAGE):
        assert bool(torch.isneginf(out[0, :3]).all())
        assert bool(torch.isnan(out[1, :3]).all())
        assert bool(torch.isfinite(out[valid & (loc != 37)]).all())


def test_locations_past_4gib():
    """Keys stored past 2^32 bytes of a cache that costs no memory (an anonymous mmap: only the
    pages written are backed) read back through int64 offsets."""
    page_bytes = L.indexer_page_bytes(PAGE)
    pages = 2 ** 32 // page_bytes + 4
    try:
        buf = mmap.mmap(-1, pages * page_bytes)
    except (OSError, ValueError, OverflowError) as e:
        pytest.skip(f"cannot map {pages * page_bytes} bytes of virtual memory: {e}")
    cache = torch.frombuffer(buf, dtype=torch.uint8).view(pages, page_bytes)
    far = torch.tensor([2 ** 31 // page_bytes * PAGE + 3, (pages - 1) * PAGE + PAGE - 1, 5])
    g = gen(13)
    set_kv.indexer_store(torch.randn(3, L.INDEX_DIM, generator=g).bfloat16(), cache, far, PAGE,
                         pow2_scale=True)
    q, w, _, _ = queries(g, 1, 8, 3, w_dtype=torch.float32)
    loc, valid = far[None], torch.ones(1, 3, dtype=torch.bool)
    want, got = both_backends("ocp", q, w, cache, loc, valid, PAGE)
    assert bool((want != 0).all())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    del cache
    buf.close()


def test_reference_follows_the_formula_in_each_dtype():
    """indexer_scores_ref (the op's torch path, given the keys) against the formula written
    head by head: fp32 weights keep fp32 (to fp32 rounding of a float64 oracle); bf16 weights
    round q.k, the relu'd product with the weight, and the head sum (accumulated in fp32) to
    bf16 (to one bf16 ulp: the accumulation order may differ)."""
    g = gen(17)
    for q_dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(3, 8, L.INDEX_DIM, generator=g).to(q_dtype)
        keys = torch.randn(3, 50, L.INDEX_DIM, generator=g)
        w = torch.randn(3, 8, generator=g)
        exact = sum((q[:, h].double().unsqueeze(1) * keys.double()).sum(-1).relu()
                    * w[:, h, None].double() for h in range(8))
        got = indexer_scores_ref(q, w, keys)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)

        wb = w.bfloat16()
        terms = torch.stack([
            ((q[:, h].bfloat16().float().unsqueeze(1) * keys.bfloat16().float()).sum(-1)
             .bfloat16().relu() * wb[:, h, None]) for h in range(8)], 1)   # bf16 per head
        want = terms.float().sum(1).bfloat16()
        got = indexer_scores_ref(q, wb, keys)
        assert got.dtype == torch.bfloat16
        ulp = (want.float().abs() * 2 ** -7).clamp_min(2 ** -126)
        assert bool(((got.float() - want.float()).abs() <= ulp).all())


@pytest.mark.parametrize("checks", ["0", "1"])
def test_one_dispatcher_op_per_call(checks):
    g = gen(19)
    cache = filled_cache(g)
    args = (*queries(g, 2, 8, 5)[:2], cache, *queries(g, 2, 8, 5)[2:], PAGE)
    kernel = KernelOptions(value_checks=checks == "1")
    seen = [name for name, _ in recorded_calls(lambda: indexer_scores(*args, kernel=kernel))]
    assert seen.count("dsv4::indexer_scores") == 1
    aten = [s for s in seen if s.startswith("aten::")]
    assert not aten if checks == "0" else len(aten) < 6   # the location range check


def test_a_valid_location_outside_the_cache():
    g = gen(23)
    cache = filled_cache(g)
    q, w, loc, valid = queries(g, 1, 8, 4)
    loc[0, 1], valid[0, 1] = SLOTS, True
    with pytest.raises(IndexError, match=f"location {SLOTS} at a valid row"):
        indexer_scores(q, w, cache, loc, valid, PAGE)
    unchecked = KernelOptions(backend="triton", value_checks=False)
    q, w, cache, loc, valid = (t.to(DEV) for t in (q, w, cache, loc, valid))
    out = indexer_scores(q, w, cache, loc, valid, PAGE, kernel=unchecked).cpu()  # no read past
    # the cache
    assert bool(out[0, 1].isnan())


def test_the_backend_follows_the_options(monkeypatch):
    if DEV.type != "cpu":
        pytest.skip("the CPU backend choice (no interpreter where a GPU exists)")
    g = gen(29)
    args = (*queries(g, 1, 8, 4)[:2], filled_cache(g), *queries(g, 1, 8, 4)[2:], PAGE)

    def backend(name=None):
        return run_recorded(*args, **({} if name is None else
                                      {"kernel": KernelOptions(backend=name)}))[0]

    assert backend() == "torch"                                 # auto: the reference on a CPU
    assert backend("hip") == "triton"                           # no HIP version
    assert backend("triton") == "triton"                        # TRITON_INTERPRET=1 here
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET=1"):
        backend("triton")


CACHE = torch.zeros(2, L.indexer_page_bytes(PAGE), dtype=torch.uint8)


@pytest.mark.parametrize("bad, error, match", [
    (dict(q=torch.zeros(2, 8, 64)), ValueError, r"q must have shape \[\*, \*, 128\]"),
    (dict(q=torch.zeros(2, 8, 128, dtype=torch.float16)), TypeError,
     "q must have dtype torch.float32 or torch.bfloat16"),
    (dict(weights=torch.zeros(2, 4)), ValueError, r"weights must have shape \[2, 8\]"),
    (dict(weights=torch.zeros(2, 8, dtype=torch.float16)), TypeError,
     "weights must have dtype torch.float32 or torch.bfloat16"),
    (dict(cache=torch.zeros(2, 100, dtype=torch.uint8)), ValueError,
     "cache page stride is 100 bytes but page_size=16 needs 2112"),
    (dict(cache=CACHE.float()), TypeError, "cache must have dtype torch.uint8"),
    (dict(cache=torch.zeros(2112, 2, dtype=torch.uint8).t()), ValueError,
     "cache must be contiguous"),
    (dict(loc=torch.zeros(3, 5, dtype=torch.int64)), ValueError, r"loc must have shape \[2, \*\]"),
    (dict(loc=torch.zeros(2, 5)), TypeError, "loc must have dtype torch.int64 or torch.int32"),
    (dict(valid=torch.ones(2, 5, dtype=torch.uint8)), TypeError, "valid must have dtype torch.bool"),
    (dict(valid=torch.ones(2, 4, dtype=torch.bool)), ValueError, r"valid must have shape \[2, 5\]"),
    (dict(page_size=0), ValueError, "page_size must be an int >= 1"),
    (dict(q="q"), TypeError, "q must be a torch.Tensor"),
    (dict(kernel="torch"), TypeError, "kernel must be a hip_kernels.KernelOptions, got str"),
    (dict(weight_scale=torch.tensor(0.5)), TypeError, "weight_scale must be a float"),
])
def test_bad_arguments_are_named(bad, error, match):
    args = dict(q=torch.zeros(2, 8, 128), weights=torch.zeros(2, 8), cache=CACHE,
                loc=torch.zeros(2, 5, dtype=torch.int64), valid=torch.ones(2, 5, dtype=torch.bool),
                page_size=PAGE) | bad
    with pytest.raises(error, match=match):
        indexer_scores(**args)


def test_the_meta_implementation_gives_the_shape_and_dtype():
    meta = dict(device="meta")
    out = op("indexer_scores", "triton")(
        torch.empty(3, 8, 128, **meta), torch.empty(3, 8, dtype=torch.bfloat16, **meta),
        torch.empty(2, L.indexer_page_bytes(PAGE), dtype=torch.uint8, **meta),
        torch.empty(3, 11, dtype=torch.int64, **meta), torch.empty(3, 11, dtype=torch.bool, **meta),
        PAGE, 1.0, "ocp", 0)
    assert out.shape == (3, 11) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_the_weight_scale_is_applied_as_torch_multiplies_by_a_float(backend, w_dtype):
    """weight_scale, applied inside the op (the model's 128^-0.5 * Hi^-0.5, no power of two for
    Hi = 24), gives the bits of the weights multiplied by it beforehand (bf16: the fp32 product
    rounded to bf16), in each backend, the shared op too."""
    g = gen(41 + (w_dtype == torch.bfloat16))
    cache = filled_cache(g)
    q, w, loc, valid = queries(g, 3, 24, 70, w_dtype=w_dtype)
    w = w * 24 ** 0.5                                   # unscaled, as weights_proj gives them
    scale = L.INDEX_DIM ** -0.5 * 24 ** -0.5
    if w_dtype == torch.bfloat16:                       # the product's rounding matters
        assert not torch.equal((w * scale).float(), w.float() * scale)
    kernel = kernel_for("ocp", backend)
    args = [a.to(DEV) for a in (q, w, cache, loc, valid)]
    want = indexer_scores(args[0], args[1] * scale, *args[2:], PAGE, kernel=kernel).cpu()
    got = indexer_scores(*args, PAGE, weight_scale=scale, kernel=kernel).cpu()
    assert torch.equal(got, want)
    row, shared_valid = args[3][0], args[4]
    want = indexer_scores_shared(args[0], args[1] * scale, args[2], row, shared_valid, PAGE,
                                 kernel=kernel).cpu()
    got = indexer_scores_shared(*args[:3], row, shared_valid, PAGE, weight_scale=scale,
                                kernel=kernel).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_the_torch_path_scores_a_long_row_tile_by_tile_with_the_bits_of_the_whole(w_dtype):
    """A row wider than KEY_TILE_COLUMNS is scored a tile of keys at a time (the dequantized
    keys of one tile alive at once): the scores are those of indexer_scores_ref over the whole
    row's keys, bit for bit (a tile is a multiple of 64 columns, as CPU GEMMs block them)."""
    g = gen(23)
    c = 2 * KEY_TILE_COLUMNS + 37
    cache = filled_cache(g)
    q, w, loc, valid = queries(g, 5, 8, c, w_dtype=w_dtype)
    got = indexer_scores(q, w, cache, loc, valid, PAGE, kernel=kernel_for("ocp", "torch"))
    keys = L.read_indexer_rows(cache, loc, PAGE, P.DIALECTS["ocp"])
    want = indexer_scores_ref(q, w, keys).masked_fill(~valid, float("-inf"))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_shared_candidates_score_as_each_query_reading_them(dialect, w_dtype):
    """indexer_scores_shared (an extend's queries of one request: one candidate list, each
    query its own visibility) gives indexer_scores' scores with that list repeated per query,
    bit for bit on the torch path, over more than one key tile; and Triton (interpreted)
    agrees with it as the per-query kernel does."""
    if DEV.type == "cuda" and dialect == "fnuz" and torch.version.hip is None:
        pytest.skip("fnuz fp8 is AMD's dialect: Triton has no such type on an NVIDIA GPU")
    g = gen(31 + (w_dtype == torch.bfloat16) + 2 * DIALECTS.index(dialect))
    cache = filled_cache(g, dialect=dialect)
    c, n = KEY_TILE_COLUMNS + 21, 6
    q, w, loc, valid = queries(g, n, 8, c, w_dtype=w_dtype)
    row = loc[0]
    valid = torch.arange(c)[None] < torch.randint(0, c + 1, (n, 1), generator=g)
    torch_kernel = kernel_for(dialect, "torch")
    want = indexer_scores(q, w, cache, row.expand(n, -1), valid, PAGE, kernel=torch_kernel)
    got = indexer_scores_shared(q, w, cache, row, valid, PAGE, kernel=torch_kernel)
    assert torch.equal(got, want)
    args = [a.to(DEV) for a in (q, w, cache, row, valid)]
    tri = indexer_scores_shared(*args, PAGE, kernel=kernel_for(dialect, "triton")).cpu()
    assert bool(torch.isneginf(tri[~valid]).all())
    if w_dtype == torch.float32:
        torch.testing.assert_close(tri[valid], want[valid], rtol=1e-5, atol=1e-6)
    else:
        keys = L.read_indexer_rows(cache, row.expand(n, -1), PAGE, P.DIALECTS[dialect])
        assert_bf16_close(tri, want, q, w, keys, valid)


@pytest.mark.parametrize("bad, match", [
    (dict(loc=torch.zeros(2, 5, dtype=torch.int64)), r"loc must have shape \[\*\]"),
    (dict(valid=torch.ones(2, 4, dtype=torch.bool)), r"valid must have shape \[2, 5\]"),
    (dict(valid=torch.ones(3, 5, dtype=torch.bool)), r"valid must have shape \[2, 5\]"),
])
def test_shared_bad_arguments_are_named(bad, match):
    args = dict(q=torch.zeros(2, 8, 128), weights=torch.zeros(2, 8), cache=CACHE,
                loc=torch.zeros(5, dtype=torch.int64), valid=torch.ones(2, 5, dtype=torch.bool),
                page_size=PAGE) | bad
    with pytest.raises(ValueError, match=match):
        indexer_scores_shared(**args)
