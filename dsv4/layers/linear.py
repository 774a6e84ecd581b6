"""A bias-free linear layer that skips torch's default initialization: every weight of the model
comes from a checkpoint or from ``init_random_weights``, and initializing ~33k expert matrices
only to overwrite them would dominate model construction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None,
                 device=None):
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=device))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, kernel=None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``F.linear(x, weight)``; kernel (the KernelOptions ``Fp8Linear`` takes) unused.
        out_dtype float32 with bf16 weights: the products (exact in fp32) summed in fp32 and not
        rounded, a tensor-parallel rank's partial product (the weight is widened per call)."""
        if out_dtype is None or out_dtype == self.weight.dtype:
            return F.linear(x, self.weight)
        return F.linear(x.to(out_dtype), self.weight.to(out_dtype))
