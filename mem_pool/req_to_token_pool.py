"""The request -> token table: req_to_token[slot, position] = the token's full-cache location.

Slot 0 is the reserved dummy slot that padded graph rows point at; live requests take slots
1..max_requests.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """req_to_token[slot, position] = full-cache location (int32); slot 0 is reserved (dummy)."""

    def __init__(self, max_requests: int, max_context_len: int, device="cpu"):
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(max_requests + 1, max_context_len, dtype=torch.int32,
                                        device=device)
        self._free = list(range(1, max_requests + 1))

    @property
    def max_requests(self) -> int:
        return self.req_to_token.shape[0] - 1

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def free(self, slot: int) -> None:
        if not 1 <= slot <= self.max_requests or slot in self._free:
            raise ValueError(f"request slot {slot} is not allocated")
        self._free.append(slot)

    def write(self, slot: int, start: int, locs: torch.Tensor) -> None:
        end = start + locs.shape[0]
        if end > self.max_context_len:
            raise ValueError(f"request slot {slot}: positions up to {end - 1} exceed "
                             f"max_context_len={self.max_context_len}")
        self.req_to_token[slot, start:end] = locs.to(torch.int32)

    def write_positions(self, slots: torch.Tensor, positions: torch.Tensor,
                        locs: torch.Tensor, highest: int) -> None:
        """req_to_token[slots[i], positions[i]] = locs[i] in one op. slots, positions and locs
        are on the table's device; highest is the largest position as a host int (the caller
        knows it), so the bound check costs no sync."""
        if highest >= self.max_context_len:
            raise ValueError(f"positions up to {highest} exceed "
                             f"max_context_len={self.max_context_len}")
        self.req_to_token[slots, positions] = locs.to(torch.int32)
