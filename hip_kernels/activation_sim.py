"""Quantization simulations the reference applies to activations (quantize, then dequantize),
used by the model's layers and by the fused ops that contain them (``indexer_query``, the
compressor's update).

- FP4 e2m1 in 32-wide blocks with power-of-two scales: the indexer's q and compressed keys.
- The Walsh-Hadamard rotation (scale d^-0.5) applied to the indexer's q and keys before FP4:
  in reference numerics as the reference's fast Hadamard transform computes it (radix-2
  butterflies in fp32, then the scale, one rounding); in fp32 numerics, one fp32 product with H_d.
(The FP8 simulation of KV rows is the cache's own quantization: ``hip_kernels.kv_layout``.)
"""

from __future__ import annotations

import functools

import torch

from .kv_layout import pow2_ceil_exponent

FP4_MAX = 6.0
FP4_BLOCK = 32
FP4_AMAX_FLOOR = FP4_MAX * 2.0 ** -126


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (nearest, ties to
    even): the grid step is 0.5 below 2, 1 in [2, 4) and 2 from 4 on, and within each binade an
    even multiple of the step is the even mantissa, so torch.round (half to even) does it."""
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, y)


def fp4_quant_dequant(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """x rounded to FP4 e2m1 per block of the last dim (scale 2^ceil(log2(amax / 6))), x's dtype."""
    z = x.float().unflatten(-1, (-1, block))
    amax = z.abs().amax(-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)
    exp = pow2_ceil_exponent(amax / FP4_MAX)
    scale = torch.ldexp(torch.ones_like(amax), exp)
    q = round_to_e2m1((z / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2).to(x.dtype)


@functools.lru_cache(maxsize=8)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * d ** -0.5).to(device)


def hadamard_rotate(x: torch.Tensor, reference: bool) -> torch.Tensor:
    """x @ H_d * d^-0.5 over the last dim (Sylvester order, H symmetric), fp32 math, one rounding
    to x's dtype. reference (the reference numerics): butterflies of stride 1, 2, 4, ... on the
    fp32 values, then times d^-0.5 in fp32; else (fp32 numerics) one fp32 GEMM with the scaled
    matrix."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"hadamard_rotate needs a power-of-two last dim, got {d}")
    if not reference:
        return (x.float() @ _hadamard(d, x.device)).to(x.dtype)
    levels = d.bit_length() - 1
    # index bits as dims, most significant first: the butterfly of stride 2^l pairs the two
    # halves of dim (levels - l)
    y = x.float().reshape(-1, *(2,) * levels)
    for dim in range(levels, 0, -1):
        low, high = y.unbind(dim)
        y = torch.stack([low + high, low - high], dim)
    return (y * d ** -0.5).view(x.shape).to(x.dtype)
