"""What one forward step reads: the batch of new tokens.

``ForwardBatch`` carries the per-row tensors of a step, as input only (nothing is written back
into it) (flattened over requests, request by
request, positions consecutive within a request); where the requests' tokens live is
``mem_pool.ReqToTokenPool``.
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
    max_seq_len: int | None = None  # the largest length the step's metadata is sized for, as a
    #                                 host int when the caller knows it (no host read then): the
    #                                 largest of seq_lens, or of prompt_lens when given
    # [B] extend only: the whole prompt each request's new tokens belong to, when the engine
    # prefills it in chunks. The widths of the reference's one-step prefill follow it (the
    # compressed rows per query, the indexer's candidate count, the window columns walked
    # before the compressed rows), so a prompt's chunks compute as its one extend would.
    # None: seq_lens.
    prompt_lens: torch.Tensor | None = None
    # The positions as host ints, when the caller knows them (eager steps): the compressors then
    # pool only the tokens that close a window, chosen without a device read. Without them
    # (captured decode graphs) every decode token pools and only boundary rows are stored.
    host_positions: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.forward_mode is ForwardMode.DECODE

    def token_request_rows(self) -> torch.Tensor:
        """[N] the batch row (0..B-1) of each new token."""
        if self.is_decode:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        return torch.repeat_interleave(torch.arange(self.batch_size, device=self.input_ids.device),
                                       self.extend_seq_lens)
