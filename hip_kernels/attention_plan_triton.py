"""The Triton kernel of `attention_plan` for a decode step: one launch per compress ratio, the
window folded into the first (a model without compressors: one launch for the window alone).

One program per (token, block of BLOCK_C compressed rows). The block-0 program of token i also
writes its window row (W slots: req_to_token -> full_to_swa, the newest column swa_write_loc when
given), its ring write row and row width, and candidate i's pooling plan (its R ring rows or its
own row, has_prev, window_start and, on a boundary, the compressed location it emits to); every
program writes its block of token i's compressed-row table. Each value is the torch body's
expression on the same integers: floor division and Python's modulo where it uses // and %,
negative indices of the tables wrapped as torch's indexing wraps them, positions clamped where it
clamps them, so the outputs are the reference's byte for byte. A table read is masked where the
reference discards the value (an invalid window column, a row past the visible ones, a token off
a boundary), so no masked lane reads memory. A ratio whose ring rows go by SWA page (``BY_PAGE``)
gathers each ring position's SWA slot through the same two tables as the window.

A decode step only: each request's one token is its only new one (``first_new`` = its position),
so a pooled row comes from this step exactly at the window's last position. An extend, shaped on
the host, runs the torch body (`attention_plan.attention_plan` resolves it so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 256            # compressed rows per program
LAUNCH_OPTIONS = {"num_warps": 4, "num_stages": 1}


@triton.jit
def _floordiv(a, b):
    """a // b as Python floors it, for b > 0 (Triton's integer division truncates)."""
    q = a // b
    return tl.where(q * b > a, q - 1, q)


@triton.jit
def _pymod(a, b):
    """a % b as Python takes it (the sign of b), for b > 0."""
    return a - _floordiv(a, b) * b


@triton.jit
def _wrap(index, n):
    """A negative index counted from the end, as torch indexes."""
    return tl.where(index < 0, index + n, index)


@triton.jit
def _full_loc(r2t_ptr, r2t_stride0, r2t_stride1, n_slots, ctx, slot, p, mask):
    """req_to_token[slot, clamp(p, 0, ctx - 1)] as int64 where mask (0 elsewhere)."""
    slot = _wrap(slot, n_slots)
    p = tl.minimum(tl.maximum(p, 0), ctx - 1)
    ok = mask & (slot >= 0) & (slot < n_slots)
    return tl.load(r2t_ptr + slot * r2t_stride0 + p * r2t_stride1, mask=ok, other=0).to(tl.int64)


@triton.jit
def _ring_row(r2t_ptr, r2t_stride0, r2t_stride1, n_slots, ctx, f2s_ptr, f2s_stride, n_full, slot,
              p, ring, ring_page, mask, BY_PAGE: tl.constexpr):
    """The ring row of (request slot, position p) where mask: by request slot, slot * ring +
    p % ring; BY_PAGE, by the SWA page of p's slot s = full_to_swa[req_to_token[slot, p]]:
    (s // ring_page) * ring + s % ring."""
    if BY_PAGE:
        full = _wrap(_full_loc(r2t_ptr, r2t_stride0, r2t_stride1, n_slots, ctx, slot, p, mask),
                     n_full)
        swa = tl.load(f2s_ptr + full * f2s_stride, mask=mask & (full >= 0) & (full < n_full),
                      other=0).to(tl.int64)
        return _floordiv(swa, ring_page) * ring + _pymod(swa, ring)
    return slot * ring + _pymod(p, ring)


@triton.jit
def attention_plan_kernel(
        pos_ptr, req_ptr, seq_ptr, n_tokens, r2t_ptr, r2t_stride0, r2t_stride1, n_slots, ctx,
        f2s_ptr, f2s_stride, n_full, swa_write_ptr, win_loc_ptr, win_valid_ptr, window,
        cand_ptr, n_cand, ratio, ring, ring_page, n_rows,
        tokens_ptr, src_state_ptr, src_new_ptr, has_prev_ptr, window_start_ptr, emit_loc_ptr,
        state_write_ptr, row_loc_ptr, row_valid_ptr, row_width_ptr,
        WINDOW: tl.constexpr, SWA_WRITE: tl.constexpr, PLAN: tl.constexpr,
        CANDIDATES: tl.constexpr, BY_PAGE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_RING: tl.constexpr,
        BLOCK_C: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    pos = tl.load(pos_ptr + i).to(tl.int64)
    req = tl.load(req_ptr + i).to(tl.int64)
    if block == 0:
        if WINDOW:      # the window: the SWA slots of positions pos - W + 1 .. pos, oldest first
            j = tl.arange(0, BLOCK_W)
            col = j < window
            q = pos - (window - 1 - j)
            valid = q >= 0
            gather = col & valid
            if SWA_WRITE:
                gather = gather & (j < window - 1)
            full = _wrap(_full_loc(r2t_ptr, r2t_stride0, r2t_stride1, n_slots, ctx, req, q,
                                   gather), n_full)
            swa = tl.load(f2s_ptr + full * f2s_stride,
                          mask=gather & (full >= 0) & (full < n_full), other=0)
            loc = tl.where(valid, swa, 0).to(tl.int32)
            if SWA_WRITE:
                newest = j == window - 1
                loc = tl.where(newest, tl.load(swa_write_ptr + i).to(tl.int32), loc)
                valid = valid | newest
            tl.store(win_loc_ptr + i * window + j, loc, mask=col)
            tl.store(win_valid_ptr + i * window + j, valid, mask=col)
        if PLAN:        # this token's ring write and row width
            seq = tl.load(seq_ptr + i).to(tl.int64)
            keep = pos >= seq - ring
            row = _ring_row(r2t_ptr, r2t_stride0, r2t_stride1, n_slots, ctx, f2s_ptr, f2s_stride,
                            n_full, req, pos, ring, ring_page, keep, BY_PAGE)
            tl.store(state_write_ptr + i, tl.where(keep, row, -1))
            tl.store(row_width_ptr + i, _floordiv(seq, ratio))
            if CANDIDATES:
                if i < n_cand:
                    token = tl.load(cand_ptr + i).to(tl.int64)
                    _candidate(i, token, pos_ptr, req_ptr, n_tokens, r2t_ptr, r2t_stride0,
                               r2t_stride1, n_slots, ctx, f2s_ptr, f2s_stride, n_full, ratio,
                               ring, ring_page, src_state_ptr, src_new_ptr, has_prev_ptr,
                               window_start_ptr, emit_loc_ptr, BY_PAGE, BLOCK_RING)
            else:       # every token a candidate, in order
                tl.store(tokens_ptr + i, i)
                _candidate(i, i, pos_ptr, req_ptr, n_tokens, r2t_ptr, r2t_stride0, r2t_stride1,
                           n_slots, ctx, f2s_ptr, f2s_stride, n_full, ratio, ring, ring_page,
                           src_state_ptr, src_new_ptr, has_prev_ptr, window_start_ptr,
                           emit_loc_ptr, BY_PAGE, BLOCK_RING)
    if PLAN:            # compressed rows c < (pos + 1) // ratio of this block
        c = block.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        col = c < n_rows
        valid = c < _floordiv(pos + 1, ratio)
        full = _full_loc(r2t_ptr, r2t_stride0, r2t_stride1, n_slots, ctx, req, c * ratio,
                         col & valid)
        tl.store(row_loc_ptr + i * n_rows + c, tl.where(valid, _floordiv(full, ratio), 0),
                 mask=col)
        tl.store(row_valid_ptr + i * n_rows + c, valid, mask=col)


@triton.jit
def _candidate(m, token, pos_ptr, req_ptr, n_tokens, r2t_ptr, r2t_stride0, r2t_stride1, n_slots,
               ctx, f2s_ptr, f2s_stride, n_full, ratio, ring, ring_page, src_state_ptr,
               src_new_ptr, has_prev_ptr, window_start_ptr, emit_loc_ptr, BY_PAGE: tl.constexpr,
               BLOCK_RING: tl.constexpr):
    """Candidate m (batch token `token`): the R rows its pool reads, oldest first, from the ring
    (positions before this step's) or this step's row (its own position); its window's start
    and, on a boundary, the compressed location it emits to."""
    t = _wrap(token, n_tokens)
    ok = (t >= 0) & (t < n_tokens)
    p = tl.load(pos_ptr + t, mask=ok, other=0).to(tl.int64)
    slot = tl.load(req_ptr + t, mask=ok, other=0).to(tl.int64)
    j = tl.arange(0, BLOCK_RING)
    qpos = p - (ring - 1 - j)
    new = qpos >= p
    src_new = tl.where(new, token - (p - qpos), -1)
    from_ring = ~new & (qpos >= 0)
    row = _ring_row(r2t_ptr, r2t_stride0, r2t_stride1, n_slots, ctx, f2s_ptr, f2s_stride, n_full,
                    slot, qpos, ring, ring_page, from_ring & (j < ring), BY_PAGE)
    src_state = tl.where(from_ring, row, -1)
    tl.store(src_new_ptr + m * ring + j, src_new, mask=j < ring)
    tl.store(src_state_ptr + m * ring + j, src_state, mask=j < ring)
    tl.store(has_prev_ptr + m, _floordiv(p, ratio) > 0)
    start = p + 1 - ratio
    tl.store(window_start_ptr + m, start)
    emit = _pymod(p + 1, ratio) == 0
    full = _full_loc(r2t_ptr, r2t_stride0, r2t_stride1, n_slots, ctx, slot, start, emit)
    tl.store(emit_loc_ptr + m, tl.where(emit, _floordiv(full, ratio), -1))


def attention_plan_triton(positions, req_pool_indices, seq_lens, rows_of_token, first_new,
                          req_to_token, full_to_swa, swa_write_loc, window, ratios, rings, tokens,
                          n_rows, ring_pages) -> list[torch.Tensor]:
    """`attention_plan`'s outputs for a decode step (rows_of_token and first_new None), the
    reference's bytes, in max(1, len(ratios)) launches. A ratio's given candidates (tokens[i]
    not None) come back as given, as the reference returns them."""
    if rows_of_token is not None or first_new is not None:
        raise ValueError("rows_of_token and first_new must be None: the Triton attention_plan "
                         "plans decode steps (an extend runs the torch reference)")
    n = positions.shape[0]
    pos, req, seq = positions.contiguous(), req_pool_indices.contiguous(), seq_lens.contiguous()
    i64 = dict(dtype=torch.int64, device=pos.device)
    win_loc = torch.empty(n, window, dtype=torch.int32, device=pos.device)
    win_valid = torch.empty(n, window, dtype=torch.bool, device=pos.device)
    out = [win_loc, win_valid]
    common = (pos, req, seq, n, req_to_token, req_to_token.stride(0), req_to_token.stride(1),
              req_to_token.shape[0], req_to_token.shape[1], full_to_swa, full_to_swa.stride(0),
              full_to_swa.shape[0],
              win_loc if swa_write_loc is None else swa_write_loc.contiguous(), win_loc,
              win_valid, window)
    window_flags = dict(SWA_WRITE=swa_write_loc is not None,
                        BLOCK_W=triton.next_power_of_2(window))
    for k, (ratio, ring, tok, rows, page) in enumerate(zip(ratios, rings, tokens, n_rows,
                                                           ring_pages)):
        m = n if tok is None else tok.shape[0]
        plan = [torch.empty(m, **i64) if tok is None else tok, torch.empty(m, ring, **i64),
                torch.empty(m, ring, **i64), torch.empty(m, dtype=torch.bool, device=pos.device),
                torch.empty(m, **i64), torch.empty(m, **i64), torch.empty(n, **i64),
                torch.empty(n, rows, **i64),
                torch.empty(n, rows, dtype=torch.bool, device=pos.device), torch.empty(n, **i64)]
        out += plan
        if n:
            cand = pos if tok is None else tok.contiguous()
            attention_plan_kernel[(n, max(1, triton.cdiv(rows, BLOCK_C)))](
                *common, cand, m, ratio, ring, max(page, 1), rows, *plan,
                WINDOW=k == 0, PLAN=True, CANDIDATES=tok is not None, BY_PAGE=page > 0,
                BLOCK_RING=triton.next_power_of_2(ring), BLOCK_C=BLOCK_C, **window_flags,
                **LAUNCH_OPTIONS)
    if not ratios and n:
        attention_plan_kernel[(n, 1)](
            *common, pos, 0, 1, 1, 1, 0, *[pos] * 10, WINDOW=True, PLAN=False,
            CANDIDATES=False, BY_PAGE=False, BLOCK_RING=1, BLOCK_C=BLOCK_C, **window_flags, **LAUNCH_OPTIONS)
    return out
