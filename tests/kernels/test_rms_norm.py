"""RMSNorm as one dispatcher op: the reference is the model's expression (bit for bit), the Triton
kernel (under the interpreter) agrees to one rounding of the output dtype, one op per call."""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import KernelOptions  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from hip_kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from op_recorder import op_names  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

DEV = default_device()
EPS = 1e-6


def inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = torch.rand(shape[-1], generator=g) + 0.5
    return x.to(DEV), w.to(DEV)


def test_reference_is_the_models_expression():
    x, w = inputs((5, 96), torch.bfloat16)
    xf = x.float()
    want = (w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS))).to(x.dtype)
    assert torch.equal(rms_norm(x, w, EPS, kernel=KernelOptions(backend="torch")), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (2, 3, 128)])
def test_triton_matches_the_reference(shape, dtype):
    """fp32 statistics both ways, summed in another order: within one rounding of dtype."""
    x, w = inputs(shape, dtype, seed=shape[-1])
    got = rms_norm(x, w, EPS, kernel=KernelOptions(backend="triton"))
    want = rms_norm_ref(x, w, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    tol = {"rtol": 8e-3, "atol": 1e-5} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got, want, **tol)


def test_one_dispatcher_op_per_call():
    x, w = inputs((4, 64), torch.bfloat16)
    assert op_names(lambda: rms_norm(x, w, EPS)) == ["dsv4::rms_norm"]


@pytest.mark.parametrize("bad, match", [
    (lambda x, w: (x.long(), w), "x must have dtype"),
    (lambda x, w: (x, w[:-1]), r"weight must have shape \[64\]"),
])
def test_bad_arguments_are_refused(bad, match):
    x, w = inputs((2, 64), torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match=match):
        rms_norm(*bad(x, w), EPS)
