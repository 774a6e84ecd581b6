"""The Triton kernels of `indexer_topk` and `picked_rows`.

`indexer_topk_kernel`: one program per query row. Every column gets the unique int64 key of
`topk_by_key` (the value's bits made monotone, NaN largest, -0 as +0, in the high 32 bits; the
lower column larger in the low 32 bits); a column that is not visible, past the row's width, or
-inf gets the sentinel INT64_MIN and is never picked. The row streams in chunks of BLOCK columns
while the program keeps its best K keys (K = k rounded up to a power of two) sorted descending
in registers: each chunk's top K (`tl.topk`, a bitonic sort) is reversed against the best
(elementwise max of a descending and an ascending run: the top K of both, a bitonic sequence)
and a bitonic merge sorts the result. Keys are unique, so the choice and its order are exactly
topk_by_key's at any row length and any chunking. The first k keys are decoded to their column,
-1 for the sentinel.

Cost per row: ceil(width / BLOCK) chunks, each a bitonic top-K of BLOCK keys
(log2 K * (log2 K + 1) / 2 compare-exchange passes over BLOCK keys; when BLOCK > K, then
log2(BLOCK / K) halvings, each a max and a log2 K pass merge) and a merge of log2 K passes over
K keys; one read of the scores and the visibility, k int64 writes. BLOCK = K for k >= 128: 45 + 9
passes per 512 columns at k 512 (Flash), 55 + 10 per 1024 at k 1024 (Pro).

`picked_rows_kernel`: a gather over the [N, k] picks, BLOCK picks per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_BLOCK = 128          # chunk length for small k: fewer loop trips, same exact result
# Four waves per row: decode has few rows (the batch), so each row's sorting network is spread
# over 256 lanes (a choice not yet timed on a GPU). No float arithmetic: fp fusion is moot.
LAUNCH_OPTIONS = {"num_warps": 4}
GATHER_BLOCK = 1024
SENTINEL = tl.constexpr(-(2 ** 63))
CANONICAL_NAN = tl.constexpr(0x7FC00000)     # the bits of torch's float("nan")


def blocks(k: int) -> tuple[int, int]:
    """(K, BLOCK): the kept keys (k rounded up to a power of two) and the chunk length."""
    keep = triton.next_power_of_2(max(k, 2))      # tl.topk of 1 would reduce to a scalar
    return keep, max(keep, MIN_BLOCK)


@triton.jit
def _keys(x_ptr, vis_ptr, cols, width):
    """topk_by_key's int64 key of each column, SENTINEL where it cannot be picked."""
    live = cols < width
    x = tl.load(x_ptr + cols, mask=live, other=float("-inf")).to(tl.float32)
    vis = tl.load(vis_ptr + cols, mask=live, other=0) != 0
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)
    bits = tl.where(x != x, CANONICAL_NAN, bits)
    value = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    key = ((value + 1) << 32) - 1 - cols.to(tl.int64)
    return tl.where(vis & (x != float("-inf")), key, SENTINEL)


@triton.jit
def indexer_topk_kernel(scores_ptr, visible_ptr, width_ptr, out_ptr, T, k,
                        HAS_WIDTH: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    width = T
    if HAS_WIDTH:
        width = tl.minimum(tl.maximum(tl.load(width_ptr + row), 0), T)
    x_ptr = scores_ptr + row * T
    vis_ptr = visible_ptr + row * T
    best = tl.full([K], SENTINEL, tl.int64)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        chunk = tl.topk(_keys(x_ptr, vis_ptr, cols, width), K)
        best = tl.bitonic_merge(tl.maximum(best, tl.flip(chunk, 0)), descending=True)
    col = (((best >> 32) + 1) << 32) - 1 - best
    pick = tl.where(best == SENTINEL, -1, col)
    slot = tl.arange(0, K)
    tl.store(out_ptr + row * k + slot, pick, mask=slot < k)


def indexer_topk_triton(scores: torch.Tensor, visible: torch.Tensor, k: int, use_aiter: bool,
                        width: torch.Tensor | None) -> torch.Tensor:
    """Contiguous scores [N, T] (fp32/bf16/fp16), visible bool [N, T], width int64 [N] or None.
    use_aiter is False here (a call on aiter runs the op's torch backend)."""
    n, t = scores.shape
    out = torch.empty(n, k, dtype=torch.int64, device=scores.device)
    if n and k:
        keep, block = blocks(k)
        has_width = width is not None
        indexer_topk_kernel[(n,)](scores, visible.view(torch.uint8),
                                  width if has_width else out, out, t, k,
                                  HAS_WIDTH=has_width, K=keep, BLOCK=block, **LAUNCH_OPTIONS)
    return out


@triton.jit
def picked_rows_kernel(loc_ptr, loc_stride_n, loc_stride_t, T, pick_ptr, rows_ptr, valid_ptr,
                       k, total, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < total
    pick = tl.load(pick_ptr + i, mask=live, other=-1)
    col = tl.maximum(pick, 0)
    src = loc_ptr + (i // k) * loc_stride_n + col * loc_stride_t
    tl.store(rows_ptr + i, tl.load(src, mask=live & (col < T)), mask=live)
    tl.store(valid_ptr + i, (pick >= 0).to(tl.uint8), mask=live)


def picked_rows_triton(loc: torch.Tensor, pick: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """loc [N, T] (any strides), contiguous pick int64 [N, k]."""
    rows = torch.empty(pick.shape, dtype=loc.dtype, device=loc.device)
    valid = torch.empty(pick.shape, dtype=torch.bool, device=loc.device)
    total = pick.numel()
    if total:
        picked_rows_kernel[(triton.cdiv(total, GATHER_BLOCK),)](
            loc, loc.stride(0), loc.stride(1), loc.shape[1], pick, rows, valid.view(torch.uint8),
            pick.shape[1], total, BLOCK=GATHER_BLOCK, **LAUNCH_OPTIONS)
    return rows, valid
