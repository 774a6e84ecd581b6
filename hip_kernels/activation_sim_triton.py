"""`activation_sim`'s simulations as Triton helpers on register tiles x [R, D] of fp32 values
(D a power of two, rows independent), for the fused kernels that contain them
(``indexer_query``, the compressor's update).

- `hadamard_butterflies`: the reference's butterflies over each row (strides 1, 2, 4, ...;
  low + high and low - high, each rounded to fp32), each element's partner fetched with
  `tl.gather`: the same additions in the same order as the reference numerics' transform, so
  the same bits; the caller multiplies by D^-0.5 (as the reference does, after the butterflies).
- `fp4_quant_dequant`: per 32-wide block of a row, scale 2^ceil(log2(max(amax, floor) / 6))
  from the fp32 bits, values times 2^-e (exact), clamped to +-6, rounded to the e2m1 grid half
  to even (the grid step times the nearest integer of value / step: `_rint` adds and subtracts
  2^23), the sign copied bitwise, times the scale. Finite inputs give the torch reference's
  values exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activation_sim import FP4_AMAX_FLOOR, FP4_BLOCK, FP4_MAX

_FP4_BLOCK = tl.constexpr(FP4_BLOCK)
_FP4_MAX = tl.constexpr(FP4_MAX)
_FP4_AMAX_FLOOR = tl.constexpr(FP4_AMAX_FLOOR)
_RINT_MAGIC = tl.constexpr(2.0 ** 23)


@triton.jit
def hadamard_butterflies(x):
    """x [R, D] fp32 times H_D (Sylvester order), unscaled, in the reference's order."""
    D: tl.constexpr = x.shape[1]
    i = tl.broadcast_to(tl.arange(0, D)[None, :], x.shape)
    for level in tl.static_range(31):
        if (1 << level) < D:
            partner = tl.gather(x, i ^ (1 << level), 1)
            x = tl.where(((i >> level) & 1) == 0, x + partner, partner - x)
    return x


@triton.jit
def _rint(t):
    """Nearest integer, ties to even, of 0 <= t < 2^22 (fp32 adds round to nearest even)."""
    return (t + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def fp4_quant_dequant(x):
    """x [R, D] fp32 rounded to FP4 e2m1 per 32-wide block with a power-of-two scale; fp32."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    z = tl.reshape(x, [R, D // _FP4_BLOCK, _FP4_BLOCK])
    amax = tl.maximum(tl.max(tl.abs(z), axis=2), _FP4_AMAX_FLOOR)
    bits = tl.div_rn(amax, tl.full(amax.shape, _FP4_MAX, tl.float32)).to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = ((exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_scale = ((127 - exp) << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.maximum(z * inv_scale[:, :, None], -_FP4_MAX), _FP4_MAX)
    a = tl.abs(v)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    q = _rint(a * (1.0 / step)) * step
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    q = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.reshape(q * scale[:, :, None], [R, D])
