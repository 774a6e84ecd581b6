"""Triton version of `rotary.rope_tail` on a register tile, for the fused kernels that contain it
(``indexer_query``, ``grouped_out_proj``).

Each rotated element is rn(rn(x * c) + rn(partner * s)), s = +-sin: the two products rounded,
then one addition, as torch's complex64 product computes (a*c - b*d, a*d + b*c). Kernels using it
launch with fp fusion off (no contraction into an fma), so the same input gives the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_tail(x, freq_row, e, live, ROPE_START: tl.constexpr, INVERSE: tl.constexpr):
    """x [R, C] fp32 (C even, columns in interleaved pairs (2i, 2i + 1)) at head-dim positions
    e (broadcast to x; ROPE_START even): the columns from ROPE_START on rotated by the token's
    factors, the others as they are; fp32, not rounded. freq_row: a pointer (or [R, 1]
    pointers) to the token's complex64 factors viewed as fp32 (cos, sin) pairs; live: where the
    factors may be read. INVERSE: by the conjugate."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    low, high = tl.split(tl.reshape(x, [R, C // 2, 2]))
    partner = tl.reshape(tl.join(high, low), [R, C])
    rope = e >= ROPE_START
    pair = tl.where(rope, (e - ROPE_START) // 2, 0)
    cos = tl.load(freq_row + 2 * pair, mask=rope & live, other=1.0)
    sin = tl.load(freq_row + 2 * pair + 1, mask=rope & live, other=0.0)
    # (a, b) -> (a*c - b*d, b*c + a*d); by the conjugate (a*c + b*d, b*c - a*d)
    sin = tl.where(((e & 1) == 1) != INVERSE, sin, -sin)
    return tl.where(rope, x * cos + partner * sin, x)
