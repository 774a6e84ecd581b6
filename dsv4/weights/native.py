"""Filling the quantized parameters of a model that holds the published formats
(``DeepseekV4Model(weights="native")``): an FP8 weight (float8_e4m3fn, or float8_e4m3fnuz on an
fnuz platform) with its 128x128 ue8m0 scales, or a packed FP4 weight (int8 [.., n, k/2]) with its
1x32 ue8m0 scales.

- ``copy_stored``: the checkpoint's bytes as they are (an OCP FP8 weight becomes fnuz exactly,
  ``hip_kernels.ocp_to_fnuz``: same bytes, scale doubled, 0x80 -> 0x00).
- ``copy_quantized``: a float value quantized as the checkpoints are (``quant.quant_fp8`` /
  ``quant.quant_fp4``: power-of-two scales), for unquantized checkpoints and random weights.
"""

from __future__ import annotations

import torch

from hip_kernels import ocp_to_fnuz

from . import quant

FP4_PACKED_DTYPE = torch.int8


def is_fp4(weight: torch.Tensor) -> bool:
    return weight.dtype == FP4_PACKED_DTYPE


def logical_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The [.., n, k] shape a quantized weight holds (FP4 packs two values a byte)."""
    shape = tuple(weight.shape)
    return quant.fp4_logical_shape(shape) if is_fp4(weight) else shape


def _as_ue8m0(scale: torch.Tensor, name: str) -> torch.Tensor:
    """Scales as float8_e8m0fnu; float scales must be powers of two (the ue8m0 values)."""
    if scale.dtype == torch.uint8:
        return scale.view(torch.float8_e8m0fnu)
    if scale.dtype == torch.float8_e8m0fnu:
        return scale
    e8 = scale.float().to(torch.float8_e8m0fnu)
    if not torch.equal(e8.float(), scale.float()):
        raise ValueError(f"{name}: scales that are not powers of two ({scale.dtype}) cannot be "
                         "held as ue8m0; load this checkpoint with weights='bf16'")
    return e8


def _copy(weight: torch.Tensor, scale: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """FP8 q is OCP e4m3fn: converted when the model's weight is fnuz."""
    if weight.dtype == torch.float8_e4m3fnuz:
        q, s = ocp_to_fnuz(q, s)
    weight.copy_(q.view(weight.dtype).reshape(weight.shape))
    scale.copy_(s.reshape(scale.shape))


def copy_stored(weight: torch.Tensor, scale: torch.Tensor, value: torch.Tensor,
                stored_scale: torch.Tensor, name: str) -> None:
    """A checkpoint's quantized tensor and its scale, in the weight's format, byte for byte."""
    _copy(weight, scale, value if is_fp4(weight) else value.view(torch.float8_e4m3fn),
          _as_ue8m0(stored_scale, name))


def copy_quantized(weight: torch.Tensor, scale: torch.Tensor, value: torch.Tensor) -> None:
    """A float value (logical shape) quantized into the weight's format."""
    value = value.reshape(logical_shape(weight))
    if is_fp4(weight):
        _copy(weight, scale, *quant.quant_fp4(value))
    else:
        _copy(weight, scale, *quant.quant_fp8(value))
