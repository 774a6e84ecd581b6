"""mHC's split + Sinkhorn as one dispatcher op: the Triton kernel (under the interpreter) against
the torch reference, one op per call, the backend choice, argument checks."""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import envs, flags, mhc_split  # noqa: E402
from hip_kernels.backend import BackendUnavailable  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402

DEV = default_device()   # the GPU where there is one (Triton compiled), else the CPU (interpreted)

HC, ITERS, EPS = 4, 20, 1e-6
WIDTH = (2 + HC) * HC


def inputs(n, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    mixes = torch.randn(n, WIDTH, generator=g) * spread
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(WIDTH, generator=g)
    mixes, scale, base = (t.to(DEV) for t in (mixes, scale, base))
    return mixes, scale, base


@pytest.mark.parametrize("n", [1, 5, 16, 33])
@pytest.mark.parametrize("iters", [1, 2, ITERS])
def test_triton_matches_the_reference(n, iters):
    """fp32 both ways in the same order; exp and division may differ in the last bit, which
    20 iterations carry to ~1e-6 relative."""
    mixes, scale, base = inputs(n, seed=n * 31 + iters)
    want = mhc_split.hc_split_ref(mixes, scale, base, HC, iters, EPS)
    got = torch.ops.dsv4.hc_split(mixes, scale, base, HC, iters, EPS, "triton")
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_columns_end_normalised():
    """The last step divides by the column sums: each column sums to 1 (up to eps)."""
    mixes, scale, base = inputs(8, seed=3)
    _, _, comb = torch.ops.dsv4.hc_split(mixes, scale, base, HC, ITERS, EPS, "triton")
    torch.testing.assert_close(comb.sum(-2).cpu(), torch.ones(8, HC), atol=1e-5, rtol=0)


def test_one_dispatcher_op_per_call():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(f"{func.namespace}::{func.overloadpacket.__name__}")
            return func(*args, **(kwargs or {}))

    mixes, scale, base = inputs(4)
    with Names():
        mhc_split.hc_split(mixes, scale, base, HC, ITERS, EPS)
    assert seen.count("dsv4::hc_split") == 1
    assert len([s for s in seen if s.startswith("aten::")]) < 5   # argument casts at most


def test_the_backend_follows_the_flag(monkeypatch):
    if DEV.type != "cpu":
        pytest.skip("the CPU backend choice (no interpreter where a GPU exists)")
    cpu = torch.device("cpu")
    assert mhc_split.backend_for(cpu, HC) == "torch"            # auto: the reference on a CPU
    monkeypatch.setenv("DSV4_KERNEL_BACKEND", "triton")
    flags.refresh()
    try:
        assert mhc_split.backend_for(cpu, HC) == "triton"       # TRITON_INTERPRET=1 here
        assert mhc_split.backend_for(cpu, 3) == "torch"         # not a power of two
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET=1"):
            mhc_split.backend_for(cpu, HC)
    finally:
        monkeypatch.delenv("DSV4_KERNEL_BACKEND")
        flags.refresh()
    assert envs.KERNEL_BACKEND.get() == "auto"


@pytest.mark.parametrize("bad, match", [
    (dict(mixes=torch.zeros(2, WIDTH + 1)), r"mixes must be fp32 \[N, 24\]"),
    (dict(mixes=torch.zeros(2, WIDTH, dtype=torch.bfloat16)), "mixes must be fp32"),
    (dict(scale=torch.zeros(2)), r"scale must be \[3\]"),
    (dict(base=torch.zeros(WIDTH - 1)), r"base \[24\]"),
    (dict(iters=0), "iters must be an int >= 1"),
])
def test_bad_arguments_are_named(bad, match):
    mixes, scale, base = inputs(2)
    args = dict(mixes=mixes, scale=scale, base=base, hc=HC, iters=ITERS, eps=EPS) | bad
    with pytest.raises(ValueError, match=match):
        mhc_split.hc_split(**args)


def test_the_meta_implementation_gives_the_shapes():
    pre, post, comb = torch.ops.dsv4.hc_split(torch.empty(7, WIDTH, device="meta"),
                                              torch.empty(3, device="meta"),
                                              torch.empty(WIDTH, device="meta"), HC, ITERS, EPS,
                                              "triton")
    assert (pre.shape, post.shape, comb.shape) == ((7, HC), (7, HC), (7, HC, HC))
