"""Which part of the model one tensor-parallel rank holds: the reference inference code's
model-parallel split, as a frozen value every sharded module gets when it is built.

A model of ``TensorSplit(rank, size, group)`` holds, of each sharded tensor, the ``rank``-th of
``size`` equal parts (``shards.py`` names them); every other tensor whole. ``size == 1`` is the
one-device model (``SINGLE``), which runs no collective. ``group`` is the ``torch.distributed``
process group the ranks reduce over (``group.py`` makes it; None = the default group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorSplit:
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size (the tensor-parallel degree) must be an int >= 1, "
                             f"got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in 0..{self.size - 1}, got {self.rank!r}")

    def part(self, n: int, what: str) -> int:
        """This rank's share of ``n`` (the count named ``what``): n / size, which must divide."""
        if n % self.size:
            raise ValueError(f"--tp {self.size}: {what}={n} is not a multiple of {self.size}")
        return n // self.size

    def start(self, n: int) -> int:
        """Where this rank's share of ``n`` begins."""
        return self.rank * (n // self.size)


SINGLE = TensorSplit()


def split_problem(config, size: int, native: bool) -> str | None:
    """Why ``config`` cannot be split over ``size`` ranks (every split count must divide, and with
    the published formats each rank's slice of an FP8 weight must be whole 128x128 blocks and
    its FP8 inputs multiples of 128), or None when it can."""
    counts = {"vocab_size": config.vocab_size, "n_heads": config.n_heads,
              "o_groups": config.o_groups, "index_n_heads": config.index_n_heads,
              "n_routed_experts": config.n_routed_experts}
    if native:
        counts["o_groups*o_lora_rank/128"] = config.o_groups * config.o_lora_rank // 128
    bad = [f"{k}={v}" for k, v in counts.items() if v % size]
    if not bad:
        return None
    return (f"--tp {size} needs each of these to be a multiple of {size}: "
            f"{', '.join(bad)} (in this config)")
