"""RMSNorm as one dispatcher op (`torch.ops.dsv4.rms_norm`): the model's norms (attn/ffn/final,
q_norm, the compressors' norm) in one launch each instead of the eight ops torch runs.

    y = (weight * (x * rsqrt(mean(x^2) + eps))).to(x.dtype)    (statistics and weight in fp32)

The torch reference is the CPU path and the oracle: it is the reference model's expression, so
the model's bits are unchanged. The Triton kernel (`rms_norm_triton`, one program per row) sums
the squares in another order and its rsqrt may differ in the last bit: it agrees with the
reference to one rounding of the output dtype, not bit for bit.
"""

from __future__ import annotations

import torch

from .backend import resolve
from .checks import check_kernel, check_tensor
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions

OP = "rms_norm"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


def _fake(x, weight, eps):
    return torch.empty_like(x)


define_op(OP, "(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm_ref, _fake,
          triton="rms_norm_triton.rms_norm_triton")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """RMSNorm of x [..., D] (bf16, fp16 or fp32) over its last dim with a weight [D] (used in fp32);
    result in x's dtype. kernel.backend picks the backend (no HIP version)."""
    check_kernel(kernel)
    check_tensor("x", x, dtypes=DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    check_tensor("weight", weight, dtypes=DTYPES, shape=(x.shape[-1],), device=x.device)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    backend = resolve(OP, x.device, kernel.backend)
    return op(OP, backend)(x.contiguous(), weight.contiguous(), float(eps))
