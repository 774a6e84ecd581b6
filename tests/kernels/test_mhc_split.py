"""mHC's split + Sinkhorn as one dispatcher op: the Triton kernel (under the interpreter) against
the torch reference, one op per call, the backend choice, argument checks."""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import KernelOptions, mhc_split  # noqa: E402
from hip_kernels.backend import BackendUnavailable  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from hip_kernels.library import op  # noqa: E402
from op_recorder import recorded_calls, recorded_ops  # noqa: E402

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
    want = mhc_split.hc_split_ref(mixes, scale, base, HC, iters, EPS, True)
    got = op("hc_split", "triton")(mixes, scale, base, HC, iters, EPS, True)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_columns_end_normalised():
    """The last step divides by the column sums: each column sums to 1 (up to eps)."""
    mixes, scale, base = inputs(8, seed=3)
    _, _, comb = op("hc_split", "triton")(mixes, scale, base, HC, ITERS, EPS, True)
    torch.testing.assert_close(comb.sum(-2).cpu(), torch.ones(8, HC), atol=1e-5, rtol=0)


def test_one_dispatcher_op_per_call():
    mixes, scale, base = inputs(4)
    seen = [name for name, _ in recorded_calls(
        lambda: mhc_split.hc_split(mixes, scale, base, HC, ITERS, EPS))]
    assert seen.count("dsv4::hc_split") == 1
    assert len([s for s in seen if s.startswith("aten::")]) < 5   # argument casts at most


def op_args(hc, **kwargs) -> tuple:
    """(the reference argument, the backend) of the hc_split op one public call runs."""
    width = (2 + hc) * hc
    mixes, scale, base = torch.zeros(1, width), torch.ones(3), torch.zeros(width)
    calls = recorded_ops(lambda: mhc_split.hc_split(mixes, scale, base, hc, 1, EPS, **kwargs))
    ((backend, args),) = [(ov, a) for name, ov, a in calls if name == "dsv4::hc_split"]
    return args[-1], backend


def test_the_backend_follows_the_options(monkeypatch):
    if DEV.type != "cpu":
        pytest.skip("the CPU backend choice (no interpreter where a GPU exists)")
    triton = KernelOptions(backend="triton")
    assert op_args(HC) == (True, "torch")                          # auto: the reference on a CPU
    assert op_args(HC, kernel=triton) == (True, "triton")         # TRITON_INTERPRET=1 here
    assert op_args(HC, kernel=KernelOptions(backend="hip")) == (True, "triton")   # no HIP one
    assert op_args(3, kernel=triton) == (True, "torch")           # not a power of two
    assert op_args(HC, reference=False) == (False, "torch")        # the op replays the numerics
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET=1"):
        op_args(HC, kernel=triton)


def test_the_reference_flag_picks_the_softmax():
    """reference: the softmax as a true division; fp32: torch's softmax (a reciprocal)."""
    mixes, scale, base = (t.cpu() for t in inputs(64, seed=5))
    for reference in (True, False):
        want = mhc_split.hc_split_ref(mixes, scale, base, HC, ITERS, EPS, reference)
        got = mhc_split.hc_split(mixes, scale, base, HC, ITERS, EPS, reference=reference,
                                 kernel=KernelOptions(backend="torch"))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    comb = [mhc_split.sinkhorn_ref(mixes[:, 2 * HC:].view(-1, HC, HC), 1, EPS, r)
            for r in (True, False)]
    assert not torch.equal(*comb)


@pytest.mark.parametrize("bad, error, match", [
    (dict(reference="yes"), TypeError, "reference must be a bool, got 'yes'"),
    (dict(kernel="triton"), TypeError, "kernel must be a hip_kernels.KernelOptions, got str"),
])
def test_bad_keyword_arguments_are_named(bad, error, match):
    mixes, scale, base = inputs(2)
    with pytest.raises(error, match=match):
        mhc_split.hc_split(mixes, scale, base, HC, ITERS, EPS, **bad)


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
    pre, post, comb = op("hc_split", "triton")(torch.empty(7, WIDTH, device="meta"),
                                               torch.empty(3, device="meta"),
                                               torch.empty(WIDTH, device="meta"), HC, ITERS, EPS,
                                               True)
    assert (pre.shape, post.shape, comb.shape) == ((7, HC), (7, HC), (7, HC, HC))
