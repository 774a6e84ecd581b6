"""Choosing the next token from a step's logits: greedy, or temperature / top-k / top-p sampling.

Greedy (temperature 0, the default) is an argmax and deterministic. Sampling draws from
softmax(logits / temperature) restricted to the top_k most likely tokens (0 = all) and to the
smallest set whose probability reaches top_p (1.0 = all), with the engine's torch.Generator, so a
seed gives the same tokens for the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """One token per row of logits [rows, vocab]."""
    if params.greedy:
        return logits.argmax(-1).tolist()
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = scores.topk(min(params.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = scores.softmax(-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist()
