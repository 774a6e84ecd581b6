"""The Triton kernel of `indexer_scores`: the lightning indexer's scores read straight from the
FP8 indexer cache, with no dequantized copy of the keys.

One program per (query n, block of BLOCK_C compressed rows). Each row's key is loaded from the
cache bytes (128 fp8 values times the row's fp32 scale, at the int64 offsets of
`indexer_offsets` and `indexer_dim_offsets`, in KEY_TILE's order); the heads are padded to
HEAD_BLOCK (at least 16, the smallest `tl.dot` tile: padded heads load zeros and get weight 0);
k.q [BLOCK_C, HEAD_BLOCK] is accumulated in fp32 over D_CHUNK-wide slices of the 128 dims, then
the head sum runs along the rows of that tile (rows by heads keeps the accumulator and the
epilogue within 64 VGPRs on MI300). D_CHUNK (16) is one tile's width, so each slice of a tiled
key is 16 contiguous bytes, as a row-major key's.

The weights are scaled in the kernel (w * w_scale in fp32, as torch multiplies a bf16 or fp32
tensor by a Python float). BF16 (reference numerics) rounds where the torch reference does: the
scaled weights to bf16, q and the keys to bf16, k.q to bf16, relu, the weighting to bf16, then
the head sum in fp32 rounded once to bf16. Without it everything stays fp32 (IEEE fp32 dot).
DOT_BF16 feeds the bf16-rounded q and keys to a bf16 `tl.dot` with fp32 accumulation: the same
exact products, on the bf16 matrix cores; the launcher sets it on a GPU only (the interpreter's
bf16 dot is wrong), so the interpreter runs the fp32 dot on the same bf16 values. Rows that are
not valid score -inf; a valid row whose location lies outside the cache reads nothing and scores
NaN, like a poisoned key.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .platform import DIALECTS, triton_interpreted
from .triton_kv_row import INDEX_DIM, fp8_constexprs, indexer_dim_offsets, indexer_offsets

BLOCK_C = 64
D_CHUNK = 16
MIN_HEAD_BLOCK = 16
# Four waves per program share the [BLOCK_C, HEAD_BLOCK] accumulator; one stage (no software
# pipelining of the loads: it costs registers, and the rows are gathered, not streamed); no fp
# contraction, as in the set-KV kernels. Measured on gfx942 with 64 heads: 54-56 VGPRs.
LAUNCH_OPTIONS = {"num_warps": 4, "num_stages": 1, "enable_fp_fusion": False}


def head_block(n_heads: int) -> int:
    """Heads padded to a power of two of at least MIN_HEAD_BLOCK."""
    return max(MIN_HEAD_BLOCK, triton.next_power_of_2(n_heads))


@triton.jit
def _round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept as fp32."""
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def indexer_scores_kernel(q_ptr, q_stride_n, q_stride_h, w_ptr, w_stride_n, w_scale, cache_ptr,
                          loc_ptr, loc_stride_n, valid_ptr, valid_stride_n, out_ptr, n_heads,
                          n_rows, num_slots, PAGE_SIZE: tl.constexpr, FP8: tl.constexpr,
                          BF16: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                          D_CHUNK: tl.constexpr, DOT_BF16: tl.constexpr = False,
                          KEY_TILE: tl.constexpr = 0):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_range = cols < n_rows
    loc = tl.load(loc_ptr + n * loc_stride_n + cols, mask=in_range, other=0).to(tl.int64)
    valid = tl.load(valid_ptr + n * valid_stride_n + cols, mask=in_range, other=0) != 0
    live = valid & (loc >= 0) & (loc < num_slots)
    value_off, scale_off = indexer_offsets(loc, PAGE_SIZE, KEY_TILE)
    scale = tl.load((cache_ptr + scale_off).to(tl.pointer_type(tl.float32)), mask=live,
                    other=0.0)

    heads = tl.arange(0, HEAD_BLOCK)
    head_ok = heads < n_heads
    q_cols = q_ptr + n * q_stride_n + heads[None, :].to(tl.int64) * q_stride_h
    acc = tl.zeros([BLOCK_C, HEAD_BLOCK], dtype=tl.float32)              # k.q, rows by heads
    for d0 in range(0, INDEX_DIM, D_CHUNK):
        dims = d0 + tl.arange(0, D_CHUNK)
        q = tl.load(q_cols + dims[:, None], mask=head_ok[None, :], other=0.0).to(tl.float32)
        k_bytes = tl.load(cache_ptr + value_off[:, None]
                          + indexer_dim_offsets(dims, KEY_TILE)[None, :], mask=live[:, None],
                          other=0)
        k = k_bytes.to(FP8, bitcast=True).to(tl.float32) * scale[:, None]
        if DOT_BF16:
            acc = tl.dot(k.to(tl.bfloat16), q.to(tl.bfloat16), acc)
        else:
            if BF16:
                q = _round_bf16(q)
                k = _round_bf16(k)
            acc = tl.dot(k, q, acc, input_precision="ieee")

    s = acc
    if BF16:
        s = _round_bf16(s)
    s = tl.where(s < 0.0, 0.0, s)                                      # relu; NaN stays NaN
    w = tl.load(w_ptr + n * w_stride_n + heads, mask=head_ok, other=0.0).to(tl.float32)
    w = w * w_scale
    if BF16:
        w = _round_bf16(w)
    terms = s * w[None, :]
    if BF16:
        terms = _round_bf16(terms)
    score = tl.sum(terms, axis=1)
    score = tl.where(live, score, float("nan"))
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + n * n_rows + cols, score.to(out_ptr.dtype.element_ty), mask=in_range)


def indexer_scores_triton(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                          loc: torch.Tensor, valid: torch.Tensor, page_size: int,
                          weight_scale: float, dialect: str, key_tile: int) -> torch.Tensor:
    """Scores [N, C] in weights' dtype, the op's triton backend (checked arguments; see
    `indexer_scores`; dialect: the fp8 dialect's name)."""
    n, n_heads = weights.shape
    c = loc.shape[1]
    out = torch.empty(n, c, dtype=weights.dtype, device=weights.device)
    if n and c:
        fp8 = fp8_constexprs(DIALECTS[dialect])["FP8"]
        bf16 = weights.dtype == torch.bfloat16
        interpreted = triton_interpreted()
        indexer_scores_kernel[(n, triton.cdiv(c, BLOCK_C))](
            q, q.stride(0), q.stride(1), weights, weights.stride(0), float(weight_scale), cache,
            loc, loc.stride(0), valid, valid.stride(0), out, n_heads, c, cache.shape[0] * page_size,
            PAGE_SIZE=page_size, FP8=fp8, BF16=bf16, HEAD_BLOCK=head_block(n_heads),
            BLOCK_C=BLOCK_C, D_CHUNK=D_CHUNK, DOT_BF16=bf16 and not interpreted,
            KEY_TILE=key_tile, **LAUNCH_OPTIONS)
    return out


def indexer_scores_shared_triton(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                                 loc: torch.Tensor, valid: torch.Tensor, page_size: int,
                                 weight_scale: float, dialect: str, key_tile: int) -> torch.Tensor:
    """`indexer_scores_shared`'s triton backend: the same kernel, every query reading the one
    list loc [C] (a stride-0 view, nothing copied)."""
    return indexer_scores_triton(q, weights, cache, loc.unsqueeze(0).expand(q.shape[0], -1),
                                 valid, page_size, weight_scale, dialect, key_tile)
