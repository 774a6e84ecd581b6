"""The collectives of the split, at the reference's points; each is a no-op on one rank.

- ``sum_over_ranks``: partial results summed in fp32 and returned in their dtype: after ``wo_b``
  (the input columns are split), after the routed experts (the experts are split), over the
  indexer's head-partial scores before top-k, and over the embedding's masked lookups.
- ``partial_dtype``: the dtype a row-parallel partial product is computed in: fp32 under a split,
  so the ranks' partials are summed unrounded and rounded once, as one rank's GEMM rounds once.
- ``gather_columns``: the head's vocab slices of the logits, concatenated in rank order.

Both run on the split's group; on a GPU they are NCCL (RCCL) calls a captured graph replays.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .split import TensorSplit


def sum_over_ranks(x: torch.Tensor, split: TensorSplit) -> torch.Tensor:
    """The sum of every rank's ``x`` (fp32 arithmetic), in x's dtype."""
    if split.size == 1:
        return x
    y = x.float().contiguous()
    dist.all_reduce(y, group=split.group)
    return y.to(x.dtype)


def partial_dtype(dtype: torch.dtype, split: TensorSplit) -> torch.dtype:
    """float32 when the split has several ranks, else dtype (one rank: the GEMM as it is)."""
    return dtype if split.size == 1 else torch.float32


def gather_columns(x: torch.Tensor, split: TensorSplit) -> torch.Tensor:
    """[..., n] of every rank -> [..., size * n], rank 0's columns first."""
    if split.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(split.size)]
    dist.all_gather(parts, x.contiguous(), group=split.group)
    return torch.cat(parts, -1)
