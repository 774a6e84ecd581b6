"""How much memory a model run needs, before anything is allocated, and how much the device has.

The weights are counted on torch's meta device (the model is built there: shapes, no storage);
the KV pool from `mem_pool.footprint` for `batch` requests of `context_len` tokens. Quantized
checkpoints are dequantized at load, so the figure is for the compute dtype (bf16). The prefill
is one extend step over every prompt token, whose attention metadata holds, per compress ratio,
an int64 location and a validity flag for each (prompt token, compressed row) pair: that grows
with the square of the prompt length and is counted too (`PREFILL_BYTES_PER_ROW`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mem_pool.kv_cache_spec import KVCacheSpec, footprint

GIB = 2 ** 30
# Bytes per (prompt token, compressed row) pair of the prefill's metadata: the int64 location
# and bool flag it keeps, and the int64 temporaries alive while they are built.
PREFILL_BYTES_PER_ROW = 32


@dataclass(frozen=True)
class MemoryEstimate:
    weight_bytes: int
    kv_bytes: int
    prefill_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.prefill_bytes

    def describe(self) -> str:
        return (f"{self.total_bytes / GIB:.1f} GiB ({self.weight_bytes / GIB:.1f} GiB of weights, "
                f"{self.kv_bytes / GIB:.2f} GiB of KV cache, {self.prefill_bytes / GIB:.2f} GiB "
                "for the prefill step)")


def prefill_bytes(config, prompt_tokens: int, context_len: int) -> int:
    """Working memory of one extend step over prompt_tokens tokens (see the module docstring)."""
    ratios = {r for r in config.compress_ratios[:config.n_layers] if r}
    rows = sum(context_len // r for r in ratios)
    return prompt_tokens * rows * PREFILL_BYTES_PER_ROW


def estimate(config, batch: int, context_len: int, page_size: int = 256,
             prompt_tokens: int = 0) -> MemoryEstimate:
    """Bytes a run of ``batch`` requests of up to ``context_len`` tokens needs, with a prefill
    of ``prompt_tokens`` tokens in all."""
    from .model import DeepseekV4Model

    model = DeepseekV4Model(config, device="meta", max_seq_len=context_len)
    tensors = [*model.parameters(), *model.buffers()]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    spec = KVCacheSpec(compress_ratios=config.compress_ratios[:config.n_layers],
                       window_size=config.window_size)
    tokens = batch * -(-context_len // page_size) * page_size
    kv = footprint(spec, page_size).total_bytes(tokens, tokens, batch + 1)
    return MemoryEstimate(weights, kv, prefill_bytes(config, prompt_tokens, context_len))


def available_bytes(device: torch.device) -> int:
    """Total memory of the GPU, or the machine's physical memory for a CPU run."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
