"""Weight quantization formats of the DeepSeek-V4 checkpoints: decode (at load) and encode (for
random test checkpoints).

- FP8: ``float8_e4m3fn`` values, one scale per ``block`` (128x128) tile, rows/columns padded up.
- FP4 (routed experts): e2m1 codes, two per byte (element 2i in the low nibble, 2i+1 in the high
  one), stored as ``int8`` (the published checkpoints) or ``float4_e2m1fn_x2``; one scale per
  1x32 block along the input dimension.
- Scales: ue8m0 (``float8_e8m0fnu``, or raw exponent bytes as ``uint8``; value 2^(byte-127)) or
  plain floats (``float32``/``bfloat16``, as in the FP8-expert "Base" checkpoints).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_BLOCK = 32
DEFAULT_FP8_BLOCK = (128, 128)

# e2m1 code -> value; codes 8..15 are the negatives of 0..7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor as float32: ue8m0 bytes become exact powers of two."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.to(torch.float32)


def fp8_scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def fp4_logical_shape(packed_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*packed_shape[:-1], packed_shape[-1] * 2)


def fp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] // FP4_BLOCK)


def dequant_fp8(q: torch.Tensor, scale: torch.Tensor,
                block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> torch.Tensor:
    """[n, k] e4m3 values times their tile's scale -> float32 [n, k]."""
    n, k = q.shape
    s = scale_to_float(scale)
    s = s.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:n, :k]
    return q.to(torch.float32) * s


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[n, k/2] packed e2m1 pairs times their 1x32 block's scale -> float32 [n, k]."""
    codes = packed.contiguous().view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1)
    values = values.flatten(-2)
    s = scale_to_float(scale).repeat_interleave(FP4_BLOCK, dim=-1)
    return values * s


def _pow2_exponent_at_least(x: torch.Tensor) -> torch.Tensor:
    """Smallest integer e with 2^e >= x (x > 0), clamped to the ue8m0 range."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return e.clamp(-127, 127)


def _ue8m0(e: torch.Tensor) -> torch.Tensor:
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quant_fp8(w: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """float [n, k] -> (e4m3 [n, k], ue8m0 scales [ceil(n/bn), ceil(k/bk)])."""
    n, k = w.shape
    sn, sk = fp8_scale_shape((n, k), block)
    padded = torch.zeros(sn * block[0], sk * block[1], dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(sn, block[0], sk, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    e = _pow2_exponent_at_least(amax / FP8_MAX)
    s = torch.ldexp(torch.ones_like(amax), e)
    q = (tiles / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:n, :k]
    return q.to(torch.float8_e4m3fn), _ue8m0(e)


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [n, k] (k a multiple of 32) -> (int8 [n, k/2] packed e2m1, ue8m0 scales [n, k/32])."""
    if w.shape[-1] % FP4_BLOCK:
        raise ValueError(f"FP4 quantization needs the input dimension to be a multiple of "
                         f"{FP4_BLOCK}, got shape {tuple(w.shape)}")
    blocks = w.float().unflatten(-1, (-1, FP4_BLOCK))
    amax = blocks.abs().amax(dim=-1).clamp_min(1e-4)
    e = _pow2_exponent_at_least(amax / FP4_MAX)
    x = blocks / torch.ldexp(torch.ones_like(amax), e)[..., None]
    # The nearest magnitude, a tie to the smaller one: a search among the midpoints (an
    # eight-way distance tensor per value made random FP4 experts a minute per layer).
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    code = torch.bucketize(x.abs(), (magnitudes[1:] + magnitudes[:-1]) / 2, out_int32=True)
    code = (code.to(torch.uint8) | (x < 0).to(torch.uint8) << 3).flatten(-2)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.view(torch.int8), _ue8m0(e)
