"""How much memory a model run needs, before anything is allocated, and how much the device has.

The weights are counted on torch's meta device (the model is built there: shapes, no storage);
the KV pool from `mem_pool.footprint` for `batch` requests of `context_len` tokens. Quantized
checkpoints are dequantized at load, so the figure is for the compute dtype (bf16).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mem_pool.kv_cache_spec import KVCacheSpec, footprint

GIB = 2 ** 30


@dataclass(frozen=True)
class MemoryEstimate:
    weight_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        return (f"{self.total_bytes / GIB:.1f} GiB ({self.weight_bytes / GIB:.1f} GiB of weights, "
                f"{self.kv_bytes / GIB:.2f} GiB of KV cache)")


def estimate(config, batch: int, context_len: int, page_size: int = 256) -> MemoryEstimate:
    from .model import DeepseekV4Model

    model = DeepseekV4Model(config, device="meta", max_seq_len=context_len)
    tensors = [*model.parameters(), *model.buffers()]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    spec = KVCacheSpec(compress_ratios=config.compress_ratios[:config.n_layers],
                       window_size=config.window_size)
    tokens = batch * -(-context_len // page_size) * page_size
    kv = footprint(spec, page_size).total_bytes(tokens, tokens, batch + 1)
    return MemoryEstimate(weights, kv)


def available_bytes(device: torch.device) -> int:
    """Total memory of the GPU, or the machine's physical memory for a CPU run."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
