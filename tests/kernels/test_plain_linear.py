"""plain_linear (the bf16 weights_proj of the indexer) as one op: the Triton kernel (interpreted
on a CPU) against the torch path, which is F.linear itself; the backend choice; bad arguments
named."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from hip_kernels import KernelOptions  # noqa: E402
from hip_kernels.library import op  # noqa: E402
from hip_kernels.plain_linear import plain_linear  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from op_recorder import backends  # noqa: E402

DEV = default_device()


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of |x| in dtype (bf16: 8 significant bits, fp16: 11, fp32: 24)."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    m, e = torch.frexp(x.float().abs())
    return torch.where(m == 0, 2.0 ** -126, torch.ldexp(torch.ones_like(m), e - bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k, r", [(1, 64, 8), (2, 256, 64), (19, 100, 17), (0, 64, 8)])
def test_triton_matches_torch_to_one_rounding(dtype, n, k, r):
    """Each output is the exact products summed in fp32 and rounded once: equal to torch's
    F.linear but for a rounding near a boundary (one ulp of the output's dtype, plus fp32's
    reordering)."""
    g = torch.Generator().manual_seed(n * 1000 + k + r)
    x = torch.randn(n, k, generator=g).to(dtype)
    w = (torch.randn(r, k, generator=g) * k ** -0.5).to(dtype)
    want = F.linear(x, w)
    assert torch.equal(plain_linear(x, w, kernel=KernelOptions(backend="torch")), want)
    got = plain_linear(x.to(DEV), w.to(DEV), kernel=KernelOptions(backend="triton")).cpu()
    assert got.dtype == dtype and got.shape == (n, r)
    exact = x.double() @ w.double().T
    bound = ulp(exact, dtype) + 1e-6 * (x.double().abs() @ w.double().abs().T)
    assert bool(((got.double() - want.double()).abs() <= 2 * bound).all())


def test_the_backend_follows_the_options():
    x, w = torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(4, 64, dtype=torch.bfloat16)
    ran = backends(lambda: plain_linear(x, w, kernel=KernelOptions(backend="torch")),
                   "dsv4::plain_linear")
    assert ran == ["torch"]
    ran = backends(lambda: plain_linear(x, w, kernel=KernelOptions(backend="triton")),
                   "dsv4::plain_linear")
    assert ran == ["triton"]


@pytest.mark.parametrize("bad, error, match", [
    (dict(x=torch.zeros(2, 64, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(x=torch.zeros(2, 3, 64)), ValueError, r"x must be 2-D, got shape \(2, 3, 64\)"),
    (dict(weight=torch.zeros(4, 32, dtype=torch.bfloat16)), ValueError,
     r"weight must have shape \[\*, 64\]"),
    (dict(weight=torch.zeros(4, 64)), TypeError, "weight must have dtype torch.bfloat16"),
    (dict(kernel="torch"), TypeError, "kernel must be a hip_kernels.KernelOptions"),
])
def test_bad_arguments_are_named(bad, error, match):
    args = dict(x=torch.zeros(2, 64, dtype=torch.bfloat16),
                weight=torch.zeros(4, 64, dtype=torch.bfloat16)) | bad
    with pytest.raises(error, match=match):
        plain_linear(**args)


def test_the_meta_implementation_gives_the_shape_and_dtype():
    out = op("plain_linear", "triton")(torch.empty(3, 64, dtype=torch.bfloat16, device="meta"),
                                       torch.empty(5, 64, dtype=torch.bfloat16, device="meta"))
    assert out.shape == (3, 5) and out.dtype == torch.bfloat16
