"""attention_plan's Triton backend (interpreted on a CPU) against its torch body, byte for byte,
on decode steps: random batches over paged tables (positions near 0 and at page edges, stale and
-1 table entries, more compressed rows than any token sees), with and without the given newest
window slot, every token a candidate (a captured step) or only those closing a window (an eager
one), ring rows by request slot or by SWA page. A decode plan is one Triton launch per ratio and nothing else a GPU would run; an extend
runs the torch body; the wrapper names a bad argument."""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import KernelOptions  # noqa: E402
from hip_kernels.attention_plan import attention_plan, attention_plan_ref  # noqa: E402
from hip_kernels.attention_plan_triton import BLOCK_C, attention_plan_triton  # noqa: E402
from hip_kernels.library import op  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from op_recorder import backends  # noqa: E402

import bench_runner  # noqa: E402,F401  (puts scripts/ on sys.path)
from gpu_launches import GpuLaunches  # noqa: E402

DEV = default_device()   # the GPU where there is one (Triton compiled), else the CPU (interpreted)
TRITON = KernelOptions(backend="triton")
TINY = dict(ratios=[4, 128], rings=[8, 128])     # the tiny preset's compress ratios, ring sizes


def paged_tables(g, slots, ctx, page, n_full):
    """req_to_token [slots, ctx] of whole pages (a page's positions at consecutive locations),
    about 1 in 16 entries stale and 1 in 16 -1 (freed out-of-window positions), and full_to_swa
    [n_full] ending with -1, some slots -1 (evicted)."""
    pages = torch.randperm(n_full // page - 1, generator=g)[:slots * (ctx // page)]
    loc = (pages.view(slots, -1, 1) * page + torch.arange(page)).view(slots, ctx)
    stale = torch.rand(slots, ctx, generator=g)
    loc = torch.where(stale < 1 / 16, torch.randint(0, n_full, (slots, ctx), generator=g), loc)
    loc[stale > 15 / 16] = -1
    full_to_swa = torch.randint(0, 4 * page, (n_full,), generator=g)
    full_to_swa[torch.rand(n_full, generator=g) < 1 / 8] = -1
    full_to_swa[-1] = -1
    return loc.to(torch.int32), full_to_swa


def decode_args(seed, n=5, window=8, ratios=(4, 128), rings=(8, 128), ctx=512, page=64,
                swa=True, closing_only=False, extra_rows=3, pos_dtype=torch.int64, past=0,
                ring_pages=None):
    """A decode step's attention_plan arguments: n requests, positions from 0..3, page edges
    (page - 1, page, page + 1 and multiples) and anywhere below ctx + past; seq_lens mostly
    position + 1 (an engine's), some longer, around a ring's length past it (where the op starts
    to skip the ring write). ring_pages: per ratio, 0 (ring rows by request slot, the default)
    or the SWA page size of its rings."""
    g = torch.Generator().manual_seed(seed)
    slots = n + 2
    req_to_token, full_to_swa = paged_tables(g, slots, ctx, page, 4 * slots * ctx)
    near = torch.tensor([0, 1, 2, 3, page - 1, page, page + 1, 2 * page - 1, 2 * page,
                         ctx - 1, ctx - page])
    pick = torch.rand(n, generator=g) < 0.6
    pos = torch.where(pick, near[torch.randint(0, len(near), (n,), generator=g)],
                      torch.randint(0, ctx + past, (n,), generator=g))
    longer = torch.rand(n, generator=g) < 0.3
    extra = torch.tensor([0, 1] + [e for r in rings for e in (r - 2, r - 1, r)] + [300])
    seq = pos + 1 + longer * extra[torch.randint(0, len(extra), (n,), generator=g)]
    req = torch.randperm(slots, generator=g)[:n]
    swa_write = torch.randint(0, 4 * page, (n,), generator=g) if swa else None
    tokens = [torch.nonzero((pos + 1) % r == 0).flatten() if closing_only else None
              for r in ratios]
    n_rows = [-(-ctx // r) + extra_rows for r in ratios]
    args = (pos.to(pos_dtype), req, seq.to(pos_dtype), None, None, req_to_token,
            full_to_swa, swa_write, window, list(ratios), list(rings), tokens, n_rows,
            [0] * len(ratios) if ring_pages is None else list(ring_pages))
    return to_device(args)


def to_device(value):
    if isinstance(value, torch.Tensor):
        return value.to(DEV)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v) for v in value)
    return value


def assert_same_bytes(args):
    want = op("attention_plan", "torch")(*args)
    got = op("attention_plan", "triton")(*args)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.dtype, g.shape, g.device) == (w.dtype, w.shape, w.device), i
        assert torch.equal(g.cpu(), w.cpu()), i


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("swa", [True, False], ids=["swa_write", "window_gathered"])
@pytest.mark.parametrize("closing_only", [False, True], ids=["every_token", "closing_only"])
def test_a_decode_plan_is_the_torch_bodys_bytes(seed, swa, closing_only):
    assert_same_bytes(decode_args(seed, swa=swa, closing_only=closing_only))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("closing_only", [False, True], ids=["every_token", "closing_only"])
def test_ring_rows_by_swa_page(seed, closing_only):
    """Rings per SWA page: each ring position's row from its SWA slot (stale, -1 and evicted
    table entries included), one ratio by page and the other by request, or both by page."""
    for pages in ((64, 0), (8, 128), (16, 256)):
        assert_same_bytes(decode_args(20 + seed, closing_only=closing_only, ring_pages=pages))


def test_ring_rows_by_swa_page_are_the_swa_pages_rings():
    """The torch body's rows: (s // P) * R + s % R of the position's SWA slot s, where the ring
    reads and where the token writes; padded rows (request 0, position 0) on SWA page 0's ring."""
    page, ring = 16, 8
    r2t = torch.arange(4 * 64).view(4, 64)              # request r's position p at r * 64 + p
    f2s = torch.cat([torch.arange(4 * 64) + 3 * page, torch.tensor([-1])])
    f2s[0] = 0                                          # location 0 maps to the dummy slot
    pos, req = torch.tensor([0, 21, 40]), torch.tensor([0, 1, 3])
    out = attention_plan_ref(pos, req, pos + 1, None, None, r2t, f2s, None, 4, [4], [ring],
                             [None], [16], [page])
    swa = lambda r, p: r * 64 + p + 3 * page if r * 64 + p else 0    # noqa: E731
    row = lambda s: s // page * ring + s % ring                      # noqa: E731
    src_state, state_write = out[3], out[8]
    assert state_write.tolist() == [row(swa(r, p)) for r, p in zip(req.tolist(), pos.tolist())]
    assert state_write[0] == 0
    want = [row(swa(1, q)) if q < 21 else -1 for q in range(14, 22)]
    assert src_state[1].tolist() == want


@pytest.mark.parametrize("window", [1, 5, 128])
def test_any_window_width(window):
    for swa in (True, False):
        assert_same_bytes(decode_args(7, window=window, swa=swa))


def test_other_ratios_and_rings():
    assert_same_bytes(decode_args(10, ratios=(2, 16, 128), rings=(4, 16, 128)))
    assert_same_bytes(decode_args(10, ratios=(2, 16, 128), rings=(4, 16, 128), closing_only=True))


def test_more_rows_than_one_program_takes():
    """A block of compressed rows per program: n_rows past BLOCK_C splits the table."""
    ctx = 4 * BLOCK_C + 256
    assert_same_bytes(decode_args(11, ctx=ctx, ratios=(4,), rings=(8,), extra_rows=5))


def test_positions_past_the_table_clamp_as_the_reference_clamps():
    assert_same_bytes(decode_args(12, n=8, ctx=128, page=16, past=300))


def test_int32_positions_and_strided_tables():
    """int32 positions and lengths (the reference widens them), a req_to_token that is a view
    of a wider table and a full_to_swa of stride 2."""
    args = list(decode_args(3, pos_dtype=torch.int32))
    wide = torch.full((args[5].shape[0], args[5].shape[1] + 40), 7, dtype=torch.int32,
                      device=DEV)
    wide[:, 20:-20] = args[5]
    args[5] = wide[:, 20:-20]
    spaced = torch.zeros(2 * args[6].shape[0], dtype=args[6].dtype, device=DEV)
    spaced[::2] = args[6]
    args[6] = spaced[::2]
    assert not args[5].is_contiguous() and not args[6].is_contiguous()
    assert_same_bytes(tuple(args))


def test_empty_shapes():
    """No compressed rows per query, no token closing a window, no ratio, no token."""
    assert_same_bytes(decode_args(5, extra_rows=0, ctx=3, page=1, ratios=(4,), rings=(8,)))
    args = decode_args(6, closing_only=True)
    args[11][0] = args[11][0][:0]
    assert_same_bytes(args)
    assert_same_bytes(decode_args(8, ratios=(), rings=()))
    assert_same_bytes(decode_args(9, n=0))


@pytest.mark.skipif(DEV.type != "cpu", reason="counts the interpreter's launches")
@pytest.mark.parametrize("closing_only", [False, True], ids=["captured", "eager"])
def test_a_tiny_decode_plan_is_one_launch_per_ratio(closing_only):
    """The tiny preset's plan (window 128, ratios 4 and 128, the newest slot given): two Triton
    launches and no torch kernel, where the torch body runs over a hundred."""
    args = decode_args(1, n=2, window=128, closing_only=closing_only, **TINY)
    with GpuLaunches() as torch_body:
        attention_plan_ref(*args)
    assert torch_body.total.n_triton == 0 and torch_body.total.n_aten > 100
    with GpuLaunches() as counted:
        attention_plan_triton(*args)
    assert (counted.total.n_triton, counted.total.aten) == (len(TINY["ratios"]), {})


def test_the_wrapper_runs_a_decode_on_triton_and_an_extend_on_torch():
    args = decode_args(2)
    ran = backends(lambda: attention_plan(*args, kernel=TRITON))
    assert ran == ["triton"]
    pos, req, seq = args[0], args[1], args[2]
    extend = (pos, req[:1], seq[:1], torch.zeros_like(pos), pos) + args[5:]
    assert backends(lambda: attention_plan(*extend, kernel=TRITON)) == ["torch"]


def test_the_triton_body_refuses_an_extend():
    args = list(decode_args(2))
    args[3] = torch.zeros_like(args[0])
    with pytest.raises(ValueError, match="rows_of_token"):
        attention_plan_triton(*args)


def _bad(index, value):
    args = list(decode_args(4))
    args[index] = value(args) if callable(value) else value
    return args


@pytest.mark.parametrize("name,index,value", [
    ("positions", 0, lambda a: a[0].float()),
    ("req_pool_indices", 1, lambda a: a[1][:-1]),
    ("seq_lens", 2, lambda a: a[2].float()),
    ("req_to_token", 5, lambda a: a[5].flatten()),
    ("full_to_swa", 6, lambda a: a[6][:, None]),
    ("swa_write_loc", 7, lambda a: a[7][:-1]),
    ("window", 8, 0),
    ("ratios, rings, tokens, n_rows and ring_pages", 12, lambda a: a[12][:1]),
    ("ring_pages", 13, [12, 0]),
    ("ring_pages", 13, [-8, 0]),
])
def test_bad_arguments_are_named(name, index, value):
    with pytest.raises((TypeError, ValueError), match=name):
        attention_plan(*_bad(index, value), kernel=TRITON)


def test_kernel_must_be_kernel_options():
    with pytest.raises(TypeError, match="kernel"):
        attention_plan(*decode_args(4), kernel="triton")
