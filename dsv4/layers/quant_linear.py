"""The linear layers of a model that computes with DeepSeek-V4's published weight formats.

``Fp8Linear`` holds an FP8 e4m3 weight [out, in] with one ue8m0 scale per 128x128 block, named
as the checkpoints name them (``<name>.weight``, ``<name>.scale``), and computes as the reference's
``linear()`` in its FP8 mode: the input quantized per 128 values (``act_quant``) and the
block-scaled GEMM, one ``hip_kernels.fp8_linear`` op. On an fnuz platform (MI300) the weight is
float8_e4m3fnuz with its scales doubled (``hip_kernels.ocp_to_fnuz``: the same values).

``make_linear`` picks the layer a projection gets: ``Fp8Linear`` where the model holds the
published formats, else the bf16 ``Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from hip_kernels import fp8_linear
from hip_kernels.options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from hip_kernels.platform import fp8_dialect

from .linear import Linear

FP8_BLOCK = 128
SCALE_DTYPE = torch.float8_e8m0fnu


def fp8_weight_dtype() -> torch.dtype:
    """float8_e4m3fn, or float8_e4m3fnuz where the platform's FP8 is fnuz."""
    return fp8_dialect().torch_dtype


def frozen(shape, dtype: torch.dtype, device) -> nn.Parameter:
    """An uninitialised parameter of a quantized dtype (no gradients: these are inference
    weights, and torch has none for FP8/FP4 bytes)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = frozen((out_features, in_features), fp8_weight_dtype(), device)
        self.scale = frozen((-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK)),
                            SCALE_DTYPE, device)

    def forward(self, x: torch.Tensor, kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """bf16 [..., in] -> [..., out] in out_dtype (float32: a tensor-parallel rank's
        partial product, not rounded)."""
        rows = x.reshape(-1, self.in_features).contiguous()
        y = fp8_linear(rows, self.weight, self.scale, out_dtype=out_dtype, kernel=kernel)
        return y.view(*x.shape[:-1], self.out_features)


def make_linear(in_features: int, out_features: int, native: bool,
                dtype: torch.dtype = torch.bfloat16, device=None) -> nn.Module:
    """``Fp8Linear`` when ``native``, else ``Linear`` in ``dtype``."""
    if native:
        return Fp8Linear(in_features, out_features, device=device)
    return Linear(in_features, out_features, dtype=dtype, device=device)
