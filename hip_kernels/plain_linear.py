"""A plain linear layer in the model's dtype, ``x @ weight.T``, as one dispatcher op
(`torch.ops.dsv4.plain_linear`): for the weights the checkpoint keeps in bf16 whatever the format
of the others (the indexer's `weights_proj`), so that a layer with native FP8/FP4 weights runs
no torch GEMM either.

The torch path (`plain_linear_ref`, `F.linear`) is the CPU path and the oracle. The Triton kernel
(`plain_linear_triton`) sums each output's exact products in fp32 in its own order and rounds
once to x's dtype, so an output can differ from torch's by one ulp of that dtype where the fp32
sum lies near a rounding boundary (the tests bound it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import resolve
from .checks import check_kernel, check_tensor
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions

OP = "plain_linear"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def plain_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _fake(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


define_op(OP, "(Tensor x, Tensor weight) -> Tensor", plain_linear_ref, _fake,
          triton="plain_linear_triton.plain_linear_triton")


def plain_linear(x: torch.Tensor, weight: torch.Tensor, *,
                 kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """[N, R] in x's dtype: x [N, K] times weight [R, K] (x's dtype) transposed. kernel.backend
    picks the backend (no HIP version)."""
    check_kernel(kernel)
    check_tensor("x", x, dtypes=DTYPES, dim=2)
    check_tensor("weight", weight, dtype=x.dtype, shape=(None, x.shape[1]), device=x.device)
    backend = resolve(OP, x.device, kernel.backend)
    if backend == "triton":
        x, weight = x.contiguous(), weight.contiguous()
    return op(OP, backend)(x, weight)
