"""The lightning indexer's choice of rows, as one dispatcher op (`torch.ops.dsv4.indexer_topk`):
the top k of each query's scores among its visible rows, -1 where fewer rows are visible; and
`torch.ops.dsv4.picked_rows`, the picked rows' locations and validity (a gather, one op).

    masked = scores, -inf where not visible;  (vals, idx) = top k of masked;
    pick = idx, -1 where vals == -inf

The torch reference (``indexer_topk_ref``) is the CPU path and the oracle. On aiter (`use_aiter`:
the caller's KernelOptions and numerics allow it, resolved on the host) the op runs aiter's
top-k. Else on a GPU it runs the Triton kernel (``indexer_topk_triton``, one program per query row, chosen by
``backend.resolve`` from the caller's ``KernelOptions``): it returns exactly ``topk_by_key``'s
choice over the masked row (with or without ``width``: ties go to the lower column), -1 where the
value is -inf, in one kernel (the GPU torch path's choice; without ``width`` the torch path runs
torch's topk, whose tie order is unspecified). ``picked_rows`` is one Triton gather on a GPU.
Both kernels are tested against the reference in the Triton interpreter, index for index.

``width`` [N] (the reference's candidate count of each query's request, ``seq_len // 4``): the
columns past it do not exist for the choice, so a row padded to a captured graph's static width
picks what it picks at its own width, ties included. On a CPU that is torch's topk over exactly
the first ``width`` columns, as the reference calls it (rows grouped by width, read on the host
inside the op; torch orders tied values by an algorithm it picks by the row length). On a GPU
(no host read in a captured step) the columns past it are -inf and ties go to the lower column
(a unique int64 key per entry), whatever the row length; on aiter they are -inf too, and ties
come in aiter's order.
"""

from __future__ import annotations

import torch

from . import aiter_ops
from .backend import resolve
from .checks import check_kernel, check_tensor
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions

OP = "indexer_topk"
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what the kernel reads exactly


def indexer_topk_ref(scores: torch.Tensor, visible: torch.Tensor, k: int,
                     use_aiter: bool, width: torch.Tensor | None = None) -> torch.Tensor:
    masked = scores.masked_fill(~visible, float("-inf"))
    if width is None:
        vals, idx = aiter_ops.topk_by(masked, k, use_aiter)
    elif use_aiter or masked.device.type != "cpu":
        cols = torch.arange(masked.shape[1], device=masked.device)
        masked = masked.masked_fill(cols >= width.unsqueeze(1), float("-inf"))
        vals, idx = aiter_ops.topk_by(masked, k, True) if use_aiter else topk_by_key(masked, k)
    else:
        vals, idx = topk_at_width(masked, k, width)
    return idx.masked_fill(vals == float("-inf"), -1)


def topk_by_key(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk of scores [N, T] by a unique int64 key per entry: the value (NaN largest, -0 equal to
    +0), then the lower column; so -inf columns appended to a row change nothing."""
    x = scores.float()
    x = torch.where(x.isnan(), float("nan"), x + 0.0).view(torch.int32).long()
    value = x ^ ((x >> 31) & 0x7FFFFFFF)                  # monotone in the value
    col = torch.arange(scores.shape[1], device=scores.device)
    idx = (value * 2 ** 32 + (2 ** 32 - 1 - col)).topk(k, dim=-1).indices
    return scores.gather(-1, idx), idx


def topk_at_width(scores: torch.Tensor, k: int,
                  width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's torch topk of its first width columns (k or fewer), -inf / 0 after them.
    CPU tensors only: the widths are read on the host (no device to wait for; the op's body is
    one step of a CPU graph, whose capture refuses host reads in the code around ops)."""
    vals = scores.new_full((scores.shape[0], k), float("-inf"))
    idx = torch.zeros(scores.shape[0], k, dtype=torch.int64, device=scores.device)
    width = width.clamp(0, scores.shape[1])
    for w in map(int, width.unique()):
        rows = (width == w).nonzero().flatten()
        kw = min(k, w)
        if kw:
            vals[rows, :kw], idx[rows, :kw] = scores[rows, :w].topk(kw, dim=-1)
    return vals, idx


def _fake(scores, visible, k, use_aiter, width):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int64)


define_op(OP, "(Tensor scores, Tensor visible, int k, bool use_aiter, Tensor? width) -> Tensor",
          indexer_topk_ref, _fake, triton="indexer_topk_triton.indexer_topk_triton")


def indexer_topk(scores: torch.Tensor, visible: torch.Tensor, k: int, *,
                 use_aiter: bool, width: torch.Tensor | None = None,
                 kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """int64 [N, k] column indices of the k largest visible scores of each row of scores
    [N, T] (visible: bool [N, T]), in descending order, -1 past a row's visible count.
    use_aiter: ``aiter_ops.topk_uses_aiter`` for this call (decided by the caller). width
    (int64 [N], optional): each row's candidate count; columns past it are never picked and
    do not change the choice (see the module docstring). kernel.backend picks the backend
    where aiter is not used (no HIP version; scores other than fp32/bf16/fp16 run the torch
    reference)."""
    check_kernel(kernel)
    check_tensor("scores", scores, dim=2)
    check_tensor("visible", visible, dtype=torch.bool, shape=tuple(scores.shape),
                 device=scores.device)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= scores.shape[1]:
        raise ValueError(f"k={k!r}: expected an int in [0, {scores.shape[1]}] (the row length)")
    if width is not None:
        check_tensor("width", width, dtype=torch.int64, shape=(scores.shape[0],),
                     device=scores.device)
    backend = resolve(OP, scores.device, kernel.backend,
                      triton_ok=not use_aiter and scores.dtype in TRITON_DTYPES)
    if backend == "triton":
        scores, visible = scores.contiguous(), visible.contiguous()
        width = None if width is None else width.contiguous()
    return op(OP, backend)(scores, visible, k, bool(use_aiter), width)


def picked_rows_ref(loc: torch.Tensor, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return loc.gather(1, pick.clamp(min=0)), pick >= 0


def _picked_fake(loc, pick):
    return loc.new_empty(pick.shape), pick.new_empty(pick.shape, dtype=torch.bool)


define_op("picked_rows", "(Tensor loc, Tensor pick) -> (Tensor, Tensor)", picked_rows_ref,
          _picked_fake, triton="indexer_topk_triton.picked_rows_triton")


def picked_rows(loc: torch.Tensor, pick: torch.Tensor, *,
                kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the picked rows' locations [N, k], valid [N, k]) from each query's candidate locations
    loc [N, T] and ``indexer_topk``'s pick [N, k] (-1: none, the row's first location, not
    valid; entries of pick below T): one op. kernel.backend picks the backend (no HIP
    version)."""
    check_kernel(kernel)
    check_tensor("loc", loc, dim=2)
    check_tensor("pick", pick, dtype=torch.int64, shape=(loc.shape[0], None), device=loc.device)
    backend = resolve("picked_rows", loc.device, kernel.backend)
    return op("picked_rows", backend)(loc, pick.contiguous() if backend == "triton" else pick)
