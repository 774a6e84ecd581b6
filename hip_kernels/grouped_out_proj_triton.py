"""The Triton kernel of `grouped_out_proj`: one program per (block of BLOCK_N tokens, group g,
block of BLOCK_R outputs). It walks group g's flattened heads (width K = H * D / G) in BLOCK_K
columns: the tile of o gets the inverse RoPE where its columns are a head's last rope_dim dims
(`rotary_triton.rope_tail`, the reference's roundings; the factors from the table's row at each
token's position), is rounded to o's dtype, and meets the
[BLOCK_R, BLOCK_K] tile of the group's weight block in a tl.dot with an fp32 accumulator; one
rounding to o's dtype at the end. On a GPU a bf16/fp16 o runs the dot on the matrix cores in
o's dtype (DOT_NATIVE: exact products, fp32 sums); the interpreter's bf16 dot is wrong, so there
the same rounded values go through an IEEE fp32 dot (the same exact products).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .platform import triton_interpreted
from .rotary_triton import rope_tail

# Decode has few tokens and streams the weight: 16 tokens (tl.dot's smallest M) by 16 outputs a
# program gives the Flash config 512 programs a step, each weight row read in 128-byte runs;
# compiled for gfx942 / gfx950 it holds 56 / 52 VGPRs (64 outputs: 94).
BLOCK_N = 16
BLOCK_R = 16
BLOCK_K = 64
LAUNCH_OPTIONS = {"num_warps": 8, "enable_fp_fusion": False}


@triton.jit
def grouped_out_proj_kernel(o_ptr, freq_ptr, freq_stride, pos_ptr, w_ptr, out_ptr, n_tokens, K,
                            R,
                            HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_K: tl.constexpr, DOT_NATIVE: tl.constexpr):
    g = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    tok_ok = (tok < n_tokens)[:, None]
    r_ok = (r < R)[:, None]
    n_groups = tl.num_programs(1)
    o_rows = o_ptr + tok[:, None] * n_groups * K + g * K
    w_rows = w_ptr + (g * R + r[:, None]).to(tl.int64) * K
    pos = tl.load(pos_ptr + tok, mask=tok < n_tokens, other=0).to(tl.int64)
    freq_rows = freq_ptr + pos[:, None] * freq_stride
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        k_ok = k < K
        x = tl.load(o_rows + k, mask=tok_ok & k_ok, other=0.0).to(tl.float32)
        e = (g * K + k) % HEAD_DIM
        x = rope_tail(x, freq_rows, e, tok_ok, HEAD_DIM - ROPE_DIM, True).to(DTYPE)
        w = tl.load(w_rows + k, mask=r_ok & k_ok, other=0.0)
        if DOT_NATIVE:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
    out = out_ptr + tok[:, None] * n_groups * R + g * R + r[None, :]
    tl.store(out, acc.to(DTYPE), mask=tok_ok & (r < R)[None, :])


def grouped_out_proj_triton(o: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
                            weight: torch.Tensor, n_groups: int, rope_dim: int) -> torch.Tensor:
    n, h, d = o.shape
    rows = weight.shape[0] // n_groups
    out = torch.empty(n, weight.shape[0], dtype=o.dtype, device=o.device)
    dot_native = o.dtype != torch.float32 and not triton_interpreted()
    if n and rows:
        grid = (triton.cdiv(n, BLOCK_N), n_groups, triton.cdiv(rows, BLOCK_R))
        freqs = torch.view_as_real(freqs_cis)
        grouped_out_proj_kernel[grid](
            o, freqs, freqs.stride(0), positions, weight, out, n, h * d // n_groups, rows,
            HEAD_DIM=d, ROPE_DIM=rope_dim, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
            DOT_NATIVE=dot_native, **LAUNCH_OPTIONS)
    return out
