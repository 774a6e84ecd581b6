"""One generation request as the engine tracks it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    index: int                          # position in the generate() call's prompt list
    prompt: list[int]
    max_new_tokens: int
    forced: list[int] | None = None     # tokens to append instead of sampling (teacher forcing)
    slot: int | None = None             # request slot in mem_pool.ReqToTokenPool while it holds KV
    seq_len: int = 0                    # tokens whose KV is stored
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    host_copy: object | None = None     # KVHostCopy while retracted
    # The request's block table on the host: the full location of each stored position, kept
    # as it grows so a step never reads it back from the device; positions before
    # swa_freed_to have had their SWA pages freed (they left the window).
    locs: list[int] = field(default_factory=list)
    swa_freed_to: int = 0
    finished: bool = False
    error: str | None = None            # why the request failed on its own

    @property
    def next_input(self) -> int:
        """The token a decode step feeds: the last one appended."""
        return self.out[-1]

    def append(self, token: int, eos_token_id: int | None) -> None:
        self.out.append(token)
        self.finished = (len(self.out) >= self.max_new_tokens
                         or (eos_token_id is not None and token == eos_token_id))

    def fail(self, error: str) -> None:
        """Stop the request with an error (the caller has released its KV)."""
        self.error, self.finished = error, True
