"""The Triton kernels of `compressor_update`: the projection, and the update as two launches.

compressor_project: one program per (block of BLOCK_M tokens, half, block of BLOCK_N columns),
half 0 = kv (x @ wkv^T), half 1 = score (x @ wgate^T, the raw gate output: the ring keeps no
position bias). The K loop runs IEEE-fp32 `tl.dot`s on x cast to fp32; at decode one program
row-block covers all the step's tokens, so each weight column is read once.

compressor_update, two launches on the stream:
1. pool + finish, one program per candidate window: BLOCK_R of its rows at a time, each from
   this step's rows (src_new >= 0) or the ring (state[max(src_state, 0)], as the reference
   gathers), per channel the kv entry and its score (with overlap, rows before `ratio` give
   their first head_dim channels, the others their second), the score plus the position bias
   ape[j % ratio] of the window's j-th row (one fp32 add, the reference's); a missing previous
   window's rows are kv 0, score -inf (masked after the add); an online softmax (running max,
   rescaled sums) gives sum(kv * p) / sum(p); then, in registers, the rounding to the model
   dtype, RMSNorm, RoPE at the window's first position and (rotate) the Hadamard butterflies
   * D^-0.5 and the FP4 simulation, each rounded to the dtype where the reference rounds
   (`activation_sim_triton`, `rotary_triton`).
2. ring write, one program per (token, block of columns): new's row copied (fp32 bits) to
   state[state_write], the scratch row (the ring's last) where it is -1, as the reference's
   index_copy_ does.
The write is its own launch because a window may read a ring row this step overwrites (the
ring wraps): programs of one launch run in no defined order, and only the launch boundary
makes every pool read happen before any write.

The projection's dot and the softmax's sums run in Triton's order and exp is Triton's: the
pooled values agree with the reference to fp32 rounding, so the outputs agree with it to a
rounding of the model dtype (and, with rotate, to an FP4 grid step where such a rounding moves
a value across an FP4 rounding boundary), not bit for bit. The ring write is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation_sim_triton import fp4_quant_dequant, hadamard_butterflies
from .rotary_triton import rope_tail

PROJECT_BLOCK_M = 16     # tl.dot's smallest tile: a decode step's tokens in one block
PROJECT_BLOCK_N = 16     # narrow: decode streams the weights, spread over many programs
PROJECT_BLOCK_K = 64
BLOCK_R = 8              # window rows per step of the pool (a ratio-4 window with overlap: 1 step)
RING_BLOCK = 256
LAUNCH_OPTIONS = {"num_warps": 4, "num_stages": 1, "enable_fp_fusion": False}


def pool_launch_options(head_dim: int) -> dict:
    """The pool + finish kernel's: 8 waves for a 512-wide row (a [BLOCK_R, 512] tile is 8
    values per lane and tensor: <= 64 VGPRs on gfx942/gfx950), else 4."""
    return {**LAUNCH_OPTIONS, "num_warps": 8 if head_dim >= 512 else 4}
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def compressor_project_kernel(x_ptr, wkv_ptr, wgate_ptr, out_ptr, n_rows, dim, width,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    gate = tl.program_id(1) == 1
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < width
    w_ptr = wkv_ptr
    if gate:
        w_ptr = wgate_ptr
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        k = k0 + kk
        k_ok = k < dim
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * dim + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * dim + k[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    out = out_ptr + rows[:, None].to(tl.int64) * (2 * width) + gate.to(tl.int32) * width
    tl.store(out + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def pool_finish_kernel(new_ptr, new_stride, state_ptr, state_stride, src_state_ptr, src_new_ptr,
                       has_prev_ptr, window_start_ptr, ape_ptr, freq_ptr, w_ptr, out_ptr, n_src,
                       eps,
                       HEAD_DIM: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr,
                       ROPE_DIM: tl.constexpr, ROTATE: tl.constexpr, BLOCK_R: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, HEAD_DIM)
    WIDTH: tl.constexpr = HEAD_DIM * (2 if OVERLAP else 1)
    has_prev = tl.load(has_prev_ptr + m) != 0
    run_max = tl.full([HEAD_DIM], NEG_INF, tl.float32)
    run_sum = tl.zeros([HEAD_DIM], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for r0 in range(0, n_src, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        keep = r < n_src
        if OVERLAP:
            second = r >= RATIO
            keep &= second | has_prev
            col = tl.where(second, HEAD_DIM, 0)[:, None] + c[None, :]
        else:
            col = tl.broadcast_to(c[None, :], [BLOCK_R, HEAD_DIM])
        sn = tl.load(src_new_ptr + m * n_src + r, mask=keep, other=-1).to(tl.int64)
        ss = tl.load(src_state_ptr + m * n_src + r, mask=keep, other=0).to(tl.int64)
        row = tl.where(sn >= 0, new_ptr + sn * new_stride,
                       state_ptr + tl.maximum(ss, 0) * state_stride)
        at = row[:, None] + col
        kv = tl.load(at, mask=keep[:, None], other=0.0)
        s = tl.load(at + WIDTH, mask=keep[:, None], other=NEG_INF)
        s += tl.load(ape_ptr + (r % RATIO)[:, None] * WIDTH + col, mask=keep[:, None],
                     other=0.0)                          # a dropped row stays -inf
        top = tl.maximum(run_max, tl.max(s, axis=0))
        shift = tl.where(top == NEG_INF, 0.0, top)       # no finite score yet: nothing to scale
        p = tl.exp(s - shift[None, :])
        rescale = tl.exp(run_max - shift)
        run_sum = run_sum * rescale + tl.sum(p, axis=0)
        acc = acc * rescale + tl.sum(p * kv, axis=0)
        run_max = top
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    x = (acc / run_sum).to(DTYPE).to(tl.float32)[None, :]
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
    w = tl.load(w_ptr + c).to(tl.float32)[None, :]
    x = (w * (x * inv_rms[:, None])).to(DTYPE).to(tl.float32)
    start = tl.maximum(tl.load(window_start_ptr + m).to(tl.int64), 0)
    x = rope_tail(x, freq_ptr + start * ROPE_DIM, c[None, :], True, HEAD_DIM - ROPE_DIM, False)
    x = x.to(DTYPE).to(tl.float32)
    if ROTATE:
        SCALE: tl.constexpr = HEAD_DIM ** -0.5
        x = (hadamard_butterflies(x) * SCALE).to(DTYPE).to(tl.float32)
        x = fp4_quant_dequant(x)
    tl.store(out_ptr + m * HEAD_DIM + c[None, :], x.to(DTYPE))


@triton.jit
def ring_write_kernel(new_ptr, new_stride, state_ptr, state_stride, write_ptr, scratch_row,
                      n_cols, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    row = tl.load(write_ptr + t).to(tl.int64)
    row = tl.where(row >= 0, row, scratch_row)
    tl.store(state_ptr + row * state_stride + cols,
             tl.load(new_ptr + t * new_stride + cols, mask=ok), mask=ok)


def compressor_project_triton(x, wkv, wgate):
    n, dim = x.shape
    width = wkv.shape[0]
    out = torch.empty(n, 2 * width, dtype=torch.float32, device=x.device)
    if n and width:
        grid = (triton.cdiv(n, PROJECT_BLOCK_M), 2, triton.cdiv(width, PROJECT_BLOCK_N))
        compressor_project_kernel[grid](x, wkv, wgate, out, n, dim, width,
                                        BLOCK_M=PROJECT_BLOCK_M, BLOCK_N=PROJECT_BLOCK_N,
                                        BLOCK_K=PROJECT_BLOCK_K, **LAUNCH_OPTIONS)
    return out


def compressor_update_triton(new, state, src_state, src_new, has_prev, window_start, state_write,
                             ape, freqs_table, norm_weight, eps, ratio, head_dim, rope_dim, overlap,
                             rotate, reference, dtype):
    """The op's triton backend. reference changes nothing here: the rotation is the reference's
    butterflies in both numerics (as `indexer_query`'s kernel)."""
    m, n_src = src_state.shape
    out = torch.empty(m, head_dim, dtype=dtype, device=new.device)
    if m:
        pool_finish_kernel[(m,)](
            new, new.stride(0), state, state.stride(0), src_state.contiguous(),
            src_new.contiguous(), has_prev, window_start, ape, torch.view_as_real(freqs_table),
            norm_weight, out, n_src, eps, HEAD_DIM=head_dim, RATIO=ratio, OVERLAP=overlap,
            ROPE_DIM=rope_dim, ROTATE=rotate, BLOCK_R=BLOCK_R, **pool_launch_options(head_dim))
    n = new.shape[0]
    if n:
        grid = (n, triton.cdiv(new.shape[1], RING_BLOCK))
        ring_write_kernel[grid](new, new.stride(0), state, state.stride(0), state_write,
                                state.shape[0] - 1, new.shape[1], BLOCK=RING_BLOCK,
                                **LAUNCH_OPTIONS)
    return out
