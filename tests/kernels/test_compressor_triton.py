"""The compressor's two fused ops on their Triton kernels (interpreted on a CPU) against the
torch references: the projection and the pooled, finished rows to a stated tolerance, the ring
write byte for byte (every ring row but the scratch row, see `ring_after`). The ring keeps the
raw gate output; the position bias is added at the pool."""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels.compressor_update import compressor_project, compressor_update  # noqa: E402
from hip_kernels.options import KernelOptions  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from op_recorder import backends  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

DEV = default_device()   # the GPU where there is one (Triton compiled), else the CPU (interpreted)
TORCH, TRITON = KernelOptions(backend="torch"), KernelOptions(backend="triton")
EPS = 1e-6


class Plan:
    """A compressor plan's fields for M candidate windows of R rows and N new tokens."""

    def __init__(self, rows, src_state, src_new, has_prev, window_start, state_write):
        t = lambda v, dtype=torch.int64: torch.tensor(v, dtype=dtype, device=DEV)  # noqa: E731
        self.src_state, self.src_new = t(src_state).view(-1, rows), t(src_new).view(-1, rows)
        self.has_prev, self.window_start = t(has_prev, torch.bool), t(window_start)
        self.state_write = t(state_write)


def tensors(n, dim, width, ratio, ring, table_len, rope, d, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = r(n, dim).bfloat16()
    wkv, wgate = r(width, dim) / dim ** 0.5, r(width, dim) / dim ** 0.5
    ape = r(ratio, width)
    state = r(ring, 2 * width) * 2
    table = torch.polar(torch.ones(table_len, rope // 2), r(table_len, rope // 2))
    w = torch.rand(d, generator=g) + 0.5
    return [v.to(DEV) for v in (x, wkv, wgate, ape, state, table, w)]


def ring_after(plan, state, new, kernel, **kw):
    """(compressed rows, the ring after the op) on a copy of state; the scratch row (the ring's
    last, where every -1 write lands in some order) is dropped."""
    ring = state.clone()
    out = compressor_update(new, ring, plan, kw.pop("ape"), kw.pop("table"), kw.pop("w"), EPS,
                            kernel=kernel, **kw)
    return out, ring[:-1]


def update_kw(d, ratio, rope, overlap, rotate, reference, ape, table, w):
    return dict(ratio=ratio, head_dim=d, rope_dim=rope, overlap=overlap, rotate=rotate,
                reference=reference, dtype=torch.bfloat16, ape=ape, table=table, w=w)


# ratio 4 with overlap (rows [A | B], 8-row windows); ratio 16 without (two BLOCK_R steps)
OVERLAP_PLAN = dict(  # 3 windows: one reading ring row 0 that this step overwrites, one without
    # a previous window (rows -1/-1 read state[0] and are ignored), one of this step's rows only
    src_state=[[0, 1, 2, 3, 4, 5, 6, -1], [-1] * 8, [-1] * 8],
    src_new=[[-1] * 7 + [1], [-1, -1, -1, -1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]],
    has_prev=[True, False, True], window_start=[4, 0, 12],
    state_write=[0, -1, 9, 10, -1, 11, 12, 13])
PLAIN_PLAN = dict(
    src_state=[list(range(16)), [-1] * 16],
    src_new=[[-1] * 15 + [0], [-1] * 12 + [0, 1, 2, 3]],
    has_prev=[True, False], window_start=[0, -12], state_write=[15, -1, 2, 3])
NO_WINDOW = dict(src_state=[], src_new=[], has_prev=[], window_start=[],
                 state_write=[3, -1, 0, 5])


@pytest.mark.parametrize("d,rope,ratio,overlap,rotate,reference,plan", [
    (64, 16, 4, True, True, True, OVERLAP_PLAN),
    (128, 64, 4, True, True, False, OVERLAP_PLAN),
    (64, 32, 4, True, False, True, OVERLAP_PLAN),
    (64, 16, 16, False, False, True, PLAIN_PLAN),
    (64, 16, 16, False, True, True, PLAIN_PLAN),
    (64, 16, 4, True, True, True, NO_WINDOW),
])
def test_triton_update_matches_the_reference(d, rope, ratio, overlap, rotate, reference, plan):
    """Pool sums and exp in Triton's order: the fp32 pool agrees to ~1e-6 relative, so a row
    differs from the reference's only where that moves a bf16 rounding (one bf16 ulp, 2^-8
    relative, then through the norm and RoPE) or, with rotate, an FP4 rounding (one e2m1 step
    of its block's scale). Such moves are rare (none in these cases under the interpreter): at
    least 99% of the values must be bit-equal (a 1% error before the FP4 rounding leaves ~97%).
    The ring write is a copy: byte for byte."""
    coff = 2 if overlap else 1
    width = coff * d
    n = len(plan["state_write"])
    x, wkv, wgate, ape, state, table, w = tensors(n, 64, width, ratio, 24, 32, rope, d, seed=d)
    p = Plan(coff * ratio, **plan)
    new = compressor_project(x, wkv, wgate)
    kw = update_kw(d, ratio, rope, overlap, rotate, reference, ape, table, w)
    want, want_ring = ring_after(p, state, new, TORCH, **dict(kw))
    got, got_ring = ring_after(p, state, new, TRITON, **dict(kw))
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got_ring.view(torch.int32), want_ring.view(torch.int32))
    if not want.numel():
        return
    assert (got == want).float().mean() >= 0.99
    g, r = got.float(), want.float()
    if rotate:   # one e2m1 step (at most 2) times the block's scale (at most amax / 3)
        amax = r.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
        bound = (2 * amax / 3).expand(-1, -1, 32).flatten(-2) + 1e-6
        assert ((g - r).abs() <= bound).all()
    else:
        torch.testing.assert_close(g, r, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("ratio,overlap,plan", [(4, True, OVERLAP_PLAN), (16, False, PLAIN_PLAN)])
def test_fp32_rows_show_the_pool_agrees_to_fp32_rounding(ratio, overlap, plan):
    """With fp32 rows no bf16 rounding hides the pool's order: measured 2.4e-7 of the row's
    amax at most (a few fp32 ulps); asserted 2e-6."""
    d, rope = 64, 16
    width, n = (2 if overlap else 1) * d, len(plan["state_write"])
    x, wkv, wgate, ape, state, table, w = tensors(n, 64, width, ratio, 24, 32, rope, d, seed=7)
    p = Plan(width // d * ratio, **plan)
    new = compressor_project(x, wkv, wgate)
    kw = {**update_kw(d, ratio, rope, overlap, False, True, ape, table, w),
          "dtype": torch.float32}
    want, _ = ring_after(p, state, new, TORCH, **dict(kw))
    got, _ = ring_after(p, state, new, TRITON, **dict(kw))
    scale = want.abs().amax(-1, keepdim=True)
    assert got.dtype == torch.float32 and ((got - want).abs() <= 2e-6 * scale).all()


def test_triton_projection_matches_the_reference():
    """One fp32 dot over dim in Triton's block order (the reference: one fp32 GEMM), no
    position bias: agreement to fp32 rounding of a dim-long sum."""
    n, dim, width, ratio = 5, 96, 80, 4
    x, wkv, wgate, *_ = tensors(n, dim, width, ratio, 2, 2, 2, 2, seed=3)
    want = compressor_project(x, wkv, wgate, kernel=TORCH)
    got = compressor_project(x, wkv, wgate, kernel=TRITON)
    assert got.dtype == torch.float32 and got.shape == (n, 2 * width)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_projection_is_fp32_under_a_bf16_default_dtype():
    """A caller that sets torch's default dtype to bf16 (as the reference inference code does)
    still gets the fp32 rows the op documents, equal to the torch reference's."""
    n, dim, width, ratio = 3, 64, 32, 4
    x, wkv, wgate, *_ = tensors(n, dim, width, ratio, 2, 2, 2, 2, seed=4)
    want = compressor_project(x, wkv, wgate, kernel=TORCH)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = compressor_project(x, wkv, wgate, kernel=TRITON)
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise_naming_them():
    d, ratio = 64, 4
    x, wkv, wgate, ape, state, table, w = tensors(2, 64, 2 * d, ratio, 24, 32, 16, d, seed=1)
    new = compressor_project(x, wkv, wgate)
    p = Plan(8, **NO_WINDOW)
    p.state_write = p.state_write[:2]
    kw = update_kw(d, ratio, 16, True, True, True, ape, table, w)
    with pytest.raises(ValueError, match="new must have 2 \\* 1 \\* head_dim"):
        ring_after(p, state, new, TORCH, **{**kw, "overlap": False})
    with pytest.raises(TypeError, match="kernel must be a hip_kernels.KernelOptions"):
        ring_after(p, state, new, "triton", **kw)
    # the projection's fp32 rows, not a lower-precision copy of them
    with pytest.raises(TypeError, match="new must have dtype torch.float32"):
        ring_after(Plan(8, **NO_WINDOW), state, new.to(torch.bfloat16), TORCH, **kw)
    # one position-bias row per phase of the window, as wide as the ring's score half
    with pytest.raises(ValueError, match=r"ape must have shape \[4, 128\]"):
        ring_after(p, state, new, TORCH, **{**kw, "ape": ape[:, :d]})
    with pytest.raises(TypeError, match="ape must have dtype torch.float32"):
        ring_after(p, state, new, TORCH, **{**kw, "ape": ape.bfloat16()})
    with pytest.raises(TypeError, match="kernel must be a hip_kernels.KernelOptions"):
        compressor_project(x, wkv, wgate, kernel=None)


@pytest.mark.parametrize("d,want", [(64, "triton"), (48, "torch")])
def test_the_update_runs_triton_where_the_kernel_covers_the_shape(d, want):
    """A head_dim that is not a power of two (the kernel holds a row in registers) runs the
    torch reference even when Triton is asked for."""
    x, wkv, wgate, ape, state, table, w = tensors(4, 64, d, 16, 24, 32, 16, d, seed=2)
    new = compressor_project(x, wkv, wgate)
    kw = update_kw(d, 16, 16, False, False, True, ape, table, w)
    assert backends(lambda: ring_after(Plan(16, **NO_WINDOW), state, new, TRITON, **kw),
                    "dsv4::compressor_update") == [want]
