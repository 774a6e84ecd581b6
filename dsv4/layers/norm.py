"""RMSNorm as in the reference: statistics in fp32, weight in fp32, result in the input dtype
(one ``hip_kernels.rms_norm`` op)."""

from __future__ import annotations

import torch
from torch import nn

from hip_kernels.options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from hip_kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor,
                kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
        """weight * x * rsqrt(mean(x^2) + eps) over the last dim, in x's dtype."""
        return rms_norm(x, self.weight, self.eps, kernel=kernel)
