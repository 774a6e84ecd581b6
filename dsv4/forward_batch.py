"""What one forward step reads: the batch of new tokens and where their requests' tokens live.

``ForwardBatch`` carries the per-row tensors of a step (flattened over requests, request by
request, positions consecutive within a request). ``ReqToTokenPool`` maps (request slot, position)
to the token's full-cache location; slot 0 is the dummy slot that padded rows point at.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"   # prompt tokens (any number per request), written then attended causally
    DECODE = "decode"   # one new token per request


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor         # [N] token ids of the new tokens
    positions: torch.Tensor         # [N] their positions in their requests
    out_cache_loc: torch.Tensor     # [N] full-cache locations allocated for them
    req_pool_indices: torch.Tensor  # [B] request slots
    seq_lens: torch.Tensor          # [B] request lengths including the new tokens
    extend_seq_lens: torch.Tensor | None = None  # [B] new tokens per request (extend only)
    max_seq_len: int | None = None  # the largest of seq_lens as a host int, when the caller
    #                                 knows it: metadata sizes are then set without a host read
    # The positions as host ints, when the caller knows them (eager steps): the compressors then
    # pool only the tokens that close a window, chosen without a device read. Without them
    # (captured decode graphs) every decode token pools and only boundary rows are stored.
    host_positions: list[int] | None = None
    # Extend only: batch token indices whose ratio-4 compressor (kv, score) rows the forward
    # hands back in ``captured_states`` (table name -> layer -> rows [K, width]), so a caller can
    # rebuild a request's state ring at a page boundary inside the step (the prefix cache).
    capture_state_rows: torch.Tensor | None = None
    captured_states: dict[str, dict[int, torch.Tensor]] | None = None

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.forward_mode is ForwardMode.DECODE

    def token_request_rows(self) -> torch.Tensor:
        """[N] the batch row (0..B-1) of each new token."""
        if self.is_decode:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        return torch.repeat_interleave(torch.arange(self.batch_size, device=self.input_ids.device),
                                       self.extend_seq_lens)


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
                        locs: torch.Tensor) -> None:
        """req_to_token[slots[i], positions[i]] = locs[i] in one op (slots and positions: host
        int64 tensors, so the bound check costs no sync)."""
        if positions.numel() and int(positions.max()) >= self.max_context_len:
            raise ValueError(f"positions up to {int(positions.max())} exceed "
                             f"max_context_len={self.max_context_len}")
        dev = self.req_to_token.device
        self.req_to_token[slots.to(dev), positions.to(dev)] = locs.to(dev, torch.int32)
