"""The tensors the split shards, by their reference checkpoint names, and how (the reference's
convert.py and model.py): vocab rows of ``embed`` and ``head``; output rows (heads, groups) of
``wq_b``, ``wo_a``, the indexer's ``wq_b`` and ``weights_proj``, and the sinks; input columns of
``wo_b``; whole routed experts by expert index. A quantized weight's scale follows its weight in
whole blocks. Everything else (wq_a, wkv, norms, compressors, gate, shared expert, mHC) is
replicated.
"""

from __future__ import annotations

import re

import torch

from .split import TensorSplit

_ROWS = re.compile(r"^(embed|head)\.weight$|^layers\.\d+\.attn\.(attn_sink|wq_b\.(weight|scale)"
                   r"|wo_a\.weight|indexer\.wq_b\.(weight|scale)|indexer\.weights_proj\.weight)$")
_COLUMNS = re.compile(r"^layers\.\d+\.attn\.wo_b\.(weight|scale)$")
_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")


def shard_dim(name: str) -> int | None:
    """The dim ``name`` is cut along (0: rows, 1: columns), None when it is not cut."""
    if _ROWS.match(name):
        return 0
    if _COLUMNS.match(name):
        return 1
    return None


def expert_of(name: str) -> int | None:
    """The routed expert a tensor belongs to (a rank holds only its own), None for the others."""
    m = _EXPERT.match(name)
    return None if m is None else int(m.group(1))


def part_range(split: TensorSplit, name: str, full_shape) -> tuple[int, int, int] | None:
    """(dim, start, length) of the rank's part of the full tensor ``name``, or None: whole."""
    dim = shard_dim(name)
    if dim is None or split.size == 1:
        return None
    n = full_shape[dim]
    length = split.part(n, f"{name} dim {dim}")
    return dim, split.rank * length, length


def take(split: TensorSplit, name: str, full: torch.Tensor) -> torch.Tensor:
    """The rank's part of a full tensor (a view)."""
    r = part_range(split, name, full.shape)
    return full if r is None else full.narrow(*r)

