"""Tensor and expert parallelism over torch.distributed: the reference's model-parallel split
(``split``, ``shards``), its collectives and the torchrun process group. docs/parallel.md."""

from .collectives import gather_columns, partial_dtype, sum_over_ranks
from .group import end_group, is_peer_failure, start_group
from .split import SINGLE, TensorSplit, split_problem

__all__ = ["SINGLE", "TensorSplit", "split_problem", "sum_over_ranks", "partial_dtype",
           "gather_columns",
           "start_group", "end_group", "is_peer_failure"]
