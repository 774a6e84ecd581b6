"""The embedding and the output head, split by vocab rows (the reference's ParallelEmbedding and
ParallelHead). On one rank: a plain lookup and a plain fp32 linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import gather_columns, sum_over_ranks
from .split import SINGLE, TensorSplit


class VocabEmbedding(nn.Module):
    """Rows start..start+part of the [vocab, dim] table. A rank looks up the ids in its rows,
    zeroes the others, and the ranks sum (exact: one rank holds each id)."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, device=None,
                 split: TensorSplit = SINGLE):
        super().__init__()
        self.split = split
        self.part = split.part(vocab_size, "vocab_size")
        self.start = split.start(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.part, dim, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.split.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.part)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return sum_over_ranks(rows.masked_fill(outside.unsqueeze(-1), 0), self.split)


class VocabHead(nn.Module):
    """fp32 [part, dim] rows of the head; logits of every rank's rows gathered in vocab order."""

    def __init__(self, vocab_size: int, dim: int, device=None, split: TensorSplit = SINGLE):
        super().__init__()
        self.split = split
        self.weight = nn.Parameter(torch.empty(split.part(vocab_size, "vocab_size"), dim,
                                               dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_columns(F.linear(x, self.weight), self.split)
