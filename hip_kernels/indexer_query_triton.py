"""The Triton kernel of `indexer_query`: one program per (token, block of BLOCK_H heads), the heads'
rows [BLOCK_H, D] held in registers through the whole chain, one load and one store:

1. RoPE on the last rope_dim dims (`rotary_triton.rope_tail`) with the factors of the token's
   row of the table (its position, read by the program), rounded to q's dtype;
2. the Hadamard rotation as the reference numerics' butterflies (the same fp32 additions, so
   the same bits: `activation_sim_triton.hadamard_butterflies`), then * D^-0.5, rounded to
   q's dtype;
3. the FP4 simulation (`activation_sim_triton.fp4_quant_dequant`, exact), rounded to q's dtype.

The butterflies serve both numerics. The fp32 numerics' reference is one fp32 GEMM with the
scaled matrix (the BLAS's order, which no kernel reproduces); the butterflies give the same
exact product with log2(D) roundings per value instead of D. Compiled for gfx942, a tl.dot
with the matrix made in registers needed 59 VGPRs and 64 KiB of LDS a program (at most one
program in a CU's 64 KiB), the butterflies 37 VGPRs and 4 KiB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation_sim_triton import fp4_quant_dequant, hadamard_butterflies
from .rotary_triton import rope_tail

BLOCK_H = 16        # heads per program
LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def indexer_query_kernel(q_ptr, freq_ptr, freq_stride, pos_ptr, out_ptr, n_heads,
                         HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    e = tl.arange(0, HEAD_DIM)[None, :]
    live = (h < n_heads)[:, None]
    offs = (tok * n_heads + h[:, None]) * HEAD_DIM + e
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    x = tl.load(q_ptr + offs, mask=live, other=0.0).to(tl.float32)
    x = rope_tail(x, freq_ptr + pos * freq_stride, e, live, HEAD_DIM - ROPE_DIM, False)
    x = x.to(DTYPE).to(tl.float32)
    SCALE: tl.constexpr = HEAD_DIM ** -0.5
    x = fp4_quant_dequant((hadamard_butterflies(x) * SCALE).to(DTYPE).to(tl.float32))
    tl.store(out_ptr + offs, x.to(DTYPE), mask=live)


def indexer_query_triton(q: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
                         n_heads: int, rope_dim: int, reference: bool) -> torch.Tensor:
    """The op's triton backend. reference changes nothing here: the kernel rotates with the
    reference's butterflies in both numerics (see `indexer_query`)."""
    n = q.shape[0]
    d = q.shape[1] // n_heads
    out = torch.empty(n, n_heads, d, dtype=q.dtype, device=q.device)
    if n:
        freqs = torch.view_as_real(freqs_cis)
        indexer_query_kernel[(n, triton.cdiv(n_heads, BLOCK_H))](
            q, freqs, freqs.stride(0), positions, out, n_heads, HEAD_DIM=d, ROPE_DIM=rope_dim,
            BLOCK_H=BLOCK_H, **LAUNCH_OPTIONS)
    return out
