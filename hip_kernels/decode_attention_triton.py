"""The Triton kernel of `sparse_decode_attention`: DeepSeek-V4's sparse attention reading the
FP8 V4 rows straight from the paged caches, with no dequantized copy of the gathered rows.

One program per (query n, block of BLOCK_H heads). The rows (window first, then compressed)
are walked in blocks of BLOCK_R = 64, the reference kernel's block: each row is dequantized
from its bytes (448 fp8 values times their tile's ue8m0 power of two, exact; 64 bf16 RoPE
values), and serves as K and as V (MQA: one shared row per token). A block's rows are read as
four [64, 128] chunks of dims, twice (for q . rows^T, then for p . rows; the second read hits
the cache): holding the whole [64, 512] block spilled registers on gfx942. An online softmax
updates the running max, the denominator and four [BLOCK_H, 128] accumulators.

REFERENCE (DeepSeek-V4's reference numerics): the running max starts at -inf and leaves the
sink out, p is rounded to bf16 for p . tile (the denominator sums it unrounded), the sink joins
the denominator after the last block; the rows are walked in the reference's order, the valid
window rows first (each in its column order), so the blocks hold the rows the reference's hold:
the program takes a prefix sum of the valid flags once, and a block's window position j below
the valid count reads the column with j valid columns before it (the number of columns whose
prefix sum is at most j). Without it (fp32 numerics) the rows are walked in column order, the
running max starts at the sink and the denominator at 1: the same value as one softmax over the
rows and the sink.

The dequantized rows are exact in bf16 and q is bf16, so on a GPU the scores are a bf16 dot with
fp32 accumulation (exact products; DOT_BF16); the interpreter's bf16 dot is not reliable, so
there the same values go through an IEEE fp32 dot (see `_pv` for P.V). Rows that are not valid
load nothing (a poisoned row at an invalid slot cannot leak) and get probability 0.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from . import kv_layout as L
from .platform import DIALECTS, triton_interpreted
from .triton_kv_row import (HEAD_DIM, NOPE_DIM, TILE, UE8M0_BIAS, fp8_type, kv_scale_offset,
                            kv_value_offset)

BLOCK_R = 64          # rows per block: the reference kernel's
BLOCK_H = 16          # heads per program (the smallest tl.dot tile; extra heads are masked)
CHUNK = tl.constexpr(128)   # dims per tile chunk: a row is 4 chunks (the 4th: 64 nope + RoPE)
# Eight waves (238 VGPRs on gfx942, no spills; four waves need 292); one stage (the rows are
# gathered, not streamed); no fp contraction, as in the other kernels.
LAUNCH_OPTIONS = {"num_warps": 8, "num_stages": 1, "enable_fp_fusion": False}


@triton.jit
def _row_pointers(swa_ptr, wloc, wok, cmp_ptr, cloc, cok, SWA_PAGE: tl.constexpr,
                  SWA_PAGE_BYTES: tl.constexpr, CMP_PAGE: tl.constexpr,
                  CMP_PAGE_BYTES: tl.constexpr):
    """Per row of a block: (value bytes, scale bytes) pointers in its segment's cache."""
    value = tl.where(wok, swa_ptr + kv_value_offset(wloc, SWA_PAGE, SWA_PAGE_BYTES),
                     cmp_ptr + kv_value_offset(cloc, CMP_PAGE, CMP_PAGE_BYTES))
    scale = tl.where(wok, swa_ptr + kv_scale_offset(wloc, SWA_PAGE, SWA_PAGE_BYTES),
                     cmp_ptr + kv_scale_offset(cloc, CMP_PAGE, CMP_PAGE_BYTES))
    return value, scale


@triton.jit
def _tile(value, scale, ok, C: tl.constexpr, FP8: tl.constexpr, AS_BF16: tl.constexpr):
    """Dims [C * CHUNK, (C + 1) * CHUNK) of a block's rows [BLOCK_R, CHUNK] (bf16 with AS_BF16:
    exact, else fp32); 0 where not ok (nothing is read there)."""
    cols = C * CHUNK + tl.arange(0, CHUNK)
    nope = cols < NOPE_DIM
    nope_mask = ok[:, None] & nope[None, :]
    fp8 = tl.load(value[:, None] + cols[None, :], mask=nope_mask, other=0)
    exp = tl.load(scale[:, None] + (cols // TILE)[None, :], mask=nope_mask, other=UE8M0_BIAS)
    two_pow = (exp.to(tl.int32) << 23).to(tl.float32, bitcast=True)   # ue8m0: 2^(e - 127)
    rope_ptr = value[:, None] + NOPE_DIM + 2 * (cols[None, :] - NOPE_DIM)
    rope = tl.load(rope_ptr.to(tl.pointer_type(tl.bfloat16)),
                   mask=ok[:, None] & (cols >= NOPE_DIM)[None, :], other=0.0)
    rows = tl.where(nope[None, :], fp8.to(FP8, bitcast=True).to(tl.float32) * two_pow,
                    rope.to(tl.float32))
    if AS_BF16:
        rows = rows.to(tl.bfloat16)
    return rows


@triton.jit
def _dot(a, b, DOT_BF16: tl.constexpr):
    """a . b in fp32: bf16 operands on the matrix cores (exact products) or an IEEE fp32 dot."""
    if DOT_BF16:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return out


@triton.jit
def _pv(p, rows, REFERENCE: tl.constexpr, DOT_BF16: tl.constexpr):
    """p . rows in fp32. Reference numerics: p rounded to bf16 (the reference's P.V). fp32
    numerics on a GPU: p split into bf16 high and low parts, two bf16 dots (16 bits of p's
    mantissa, relative error under 2^-16); interpreted: an IEEE fp32 dot."""
    if REFERENCE:
        out = _dot(p.to(tl.bfloat16), rows, DOT_BF16)
    elif DOT_BF16:
        hi = p.to(tl.bfloat16)
        lo = (p - hi.to(tl.float32)).to(tl.bfloat16)
        out = tl.dot(hi, rows) + tl.dot(lo, rows)
    else:
        out = _dot(p, rows, False)
    return out


@triton.jit
def _load_q(q_row, q_stride_h, heads, head_ok, C: tl.constexpr):
    """Dims of chunk C of the block's heads of one query [BLOCK_H, CHUNK] (0 past n_heads)."""
    cols = C * CHUNK + tl.arange(0, CHUNK)
    return tl.load(q_row + heads[:, None].to(tl.int64) * q_stride_h + cols[None, :],
                   mask=head_ok[:, None], other=0.0)


@triton.jit
def sparse_decode_attention_kernel(
        q_ptr, q_stride_n, q_stride_h, out_ptr, o_stride_n, o_stride_h, sink_ptr, scale, n_heads,
        swa_ptr, wloc_ptr, wloc_stride, wvalid_ptr, wvalid_stride, n_window, swa_slots,
        cmp_ptr, cloc_ptr, cloc_stride, cvalid_ptr, cvalid_stride, n_comp, cmp_slots,
        SWA_PAGE: tl.constexpr, SWA_PAGE_BYTES: tl.constexpr, CMP_PAGE: tl.constexpr,
        CMP_PAGE_BYTES: tl.constexpr, FP8: tl.constexpr, REFERENCE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
        DOT_BF16: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < n_heads
    q_row = q_ptr + n * q_stride_n
    q0 = _load_q(q_row, q_stride_h, heads, head_ok, 0)
    q1 = _load_q(q_row, q_stride_h, heads, head_ok, 1)
    q2 = _load_q(q_row, q_stride_h, heads, head_ok, 2)
    q3 = _load_q(q_row, q_stride_h, heads, head_ok, 3)
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0)
    if REFERENCE:
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_H], tl.float32)
    else:
        m = sink
        denom = tl.full([BLOCK_H], 1.0, tl.float32)
    acc0 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    acc1 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    acc2 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    acc3 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    if REFERENCE:   # valid window columns up to each column (inclusive), and in all
        wcol = tl.arange(0, BLOCK_W)
        wvalid = tl.load(wvalid_ptr + n * wvalid_stride + wcol, mask=wcol < n_window, other=0)
        wseen = tl.cumsum((wvalid != 0).to(tl.int32), 0)
        n_valid = tl.max(wseen, 0)
    total = n_window + n_comp
    for r0 in range(0, total, BLOCK_R):
        j = r0 + tl.arange(0, BLOCK_R)
        in_win = j < n_window
        in_cmp = (j >= n_window) & (j < total)
        cj = j - n_window
        if REFERENCE:   # position j < n_valid: the valid column with j valid ones before it
            wok = j < n_valid
            wj = tl.sum((wseen[None, :] <= j[:, None]).to(tl.int32), axis=1)
        else:
            wok = tl.load(wvalid_ptr + n * wvalid_stride + j, mask=in_win, other=0) != 0
            wj = j
        wloc = tl.load(wloc_ptr + n * wloc_stride + wj, mask=in_win & wok, other=0).to(tl.int64)
        cloc = tl.load(cloc_ptr + n * cloc_stride + cj, mask=in_cmp, other=0).to(tl.int64)
        cok = tl.load(cvalid_ptr + n * cvalid_stride + cj, mask=in_cmp, other=0) != 0
        valid = (in_win & wok) | (in_cmp & cok)
        wok = in_win & wok & (wloc >= 0) & (wloc < swa_slots)     # rows actually read
        cok = in_cmp & cok & (cloc >= 0) & (cloc < cmp_slots)
        value, scale_ptr = _row_pointers(swa_ptr, wloc, wok, cmp_ptr, cloc, cok, SWA_PAGE,
                                         SWA_PAGE_BYTES, CMP_PAGE, CMP_PAGE_BYTES)
        ok = wok | cok
        # scores over the four 128-wide dim chunks (each chunk read once here, again for p.V)
        s = _dot(q0, tl.trans(_tile(value, scale_ptr, ok, 0, FP8, DOT_BF16)), DOT_BF16)
        s += _dot(q1, tl.trans(_tile(value, scale_ptr, ok, 1, FP8, DOT_BF16)), DOT_BF16)
        s += _dot(q2, tl.trans(_tile(value, scale_ptr, ok, 2, FP8, DOT_BF16)), DOT_BF16)
        s += _dot(q3, tl.trans(_tile(value, scale_ptr, ok, 3, FP8, DOT_BF16)), DOT_BF16)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        live = m_new != float("-inf")                 # a head with no valid row yet
        alpha = tl.where(live, tl.exp(m - m_new), 1.0)
        p = tl.where(live[:, None], tl.exp(s - m_new[:, None]), 0.0)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc0 = acc0 * alpha[:, None] + _pv(p, _tile(value, scale_ptr, ok, 0, FP8, DOT_BF16),
                                            REFERENCE, DOT_BF16)
        acc1 = acc1 * alpha[:, None] + _pv(p, _tile(value, scale_ptr, ok, 1, FP8, DOT_BF16),
                                            REFERENCE, DOT_BF16)
        acc2 = acc2 * alpha[:, None] + _pv(p, _tile(value, scale_ptr, ok, 2, FP8, DOT_BF16),
                                            REFERENCE, DOT_BF16)
        acc3 = acc3 * alpha[:, None] + _pv(p, _tile(value, scale_ptr, ok, 3, FP8, DOT_BF16),
                                            REFERENCE, DOT_BF16)
        m = m_new
    if REFERENCE:
        denom = denom + tl.exp(sink - m)
    o_row = out_ptr + n * o_stride_n + heads[:, None].to(tl.int64) * o_stride_h
    cols = tl.arange(0, CHUNK)[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(o_row + cols, (acc0 / denom[:, None]).to(dt), mask=head_ok[:, None])
    tl.store(o_row + CHUNK + cols, (acc1 / denom[:, None]).to(dt), mask=head_ok[:, None])
    tl.store(o_row + 2 * CHUNK + cols, (acc2 / denom[:, None]).to(dt), mask=head_ok[:, None])
    tl.store(o_row + 3 * CHUNK + cols, (acc3 / denom[:, None]).to(dt), mask=head_ok[:, None])


def sparse_decode_attention_triton(q, swa_cache, window_loc, window_valid, swa_page_size,
                                   comp_cache, comp_loc, comp_valid, comp_page_size, sink, scale,
                                   reference, dialect) -> torch.Tensor:
    """o [N, H, 512], the op's triton backend (checked arguments; see
    `decode_attention.sparse_decode_attention`; dialect: the fp8 dialect's name)."""
    n, n_heads = q.shape[:2]
    out = torch.empty_like(q)
    if n == 0:
        return out
    if comp_cache is None:   # an empty segment: any tensor stands for its pointers
        comp_cache, comp_loc, comp_valid = swa_cache, window_loc[:, :0], window_valid[:, :0]
        comp_page_size = swa_page_size
    dot_bf16 = q.dtype == torch.bfloat16 and not triton_interpreted()
    grid = (n, triton.cdiv(n_heads, BLOCK_H))
    sparse_decode_attention_kernel[grid](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), sink, float(scale),
        n_heads, swa_cache, window_loc, window_loc.stride(0), window_valid,
        window_valid.stride(0), window_loc.shape[1], swa_cache.shape[0] * swa_page_size,
        comp_cache, comp_loc, max(comp_loc.stride(0), 1), comp_valid,
        max(comp_valid.stride(0), 1), comp_loc.shape[1], comp_cache.shape[0] * comp_page_size,
        SWA_PAGE=swa_page_size, SWA_PAGE_BYTES=L.page_bytes(swa_page_size),
        CMP_PAGE=comp_page_size, CMP_PAGE_BYTES=L.page_bytes(comp_page_size),
        FP8=fp8_type(DIALECTS[dialect]), REFERENCE=bool(reference), BLOCK_H=BLOCK_H,
        BLOCK_R=BLOCK_R, BLOCK_W=triton.next_power_of_2(max(window_loc.shape[1], 1)),
        DOT_BF16=dot_bf16, **LAUNCH_OPTIONS)
    return out
