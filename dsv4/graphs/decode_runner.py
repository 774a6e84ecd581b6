"""The engine's decode step as a graph: static inputs, the captured step, and the padding rule.

Padded rows point at request slot 0 and full location 0 (the reserved dummy slot and page 0 of
the allocator), with seq_lens 1 and position 0, so they never write live KV. The compressed rows
per query are fixed (`model.static_max_rows`), so every captured step has static shapes.
"""

from __future__ import annotations

import torch

from ..forward_batch import ForwardBatch, ForwardMode
from ..options import Options
from .runner import GraphRunner

INPUT_NAMES = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
PAD_VALUES = {"seq_lens": 1}  # every other input pads with 0: slot 0, location 0, position 0


def decode_inputs(batch: ForwardBatch) -> dict[str, torch.Tensor]:
    """The runner's view of a decode batch: name -> [B] tensor."""
    return {name: getattr(batch, name) for name in INPUT_NAMES}


def make_decode_graph_runner(model, pool, req_to_token: torch.Tensor, max_batch: int,
                             max_context_len: int, device, options: Options) -> GraphRunner:
    """A GraphRunner over one decode step of `model` on `pool` with `options` (not captured
    yet)."""
    max_rows = model.static_max_rows(max_context_len)

    def make_static_inputs(n: int) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(n, dtype=torch.int64, device=device) for name in INPUT_NAMES}

    def step(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = ForwardBatch(ForwardMode.DECODE, *(inputs[name] for name in INPUT_NAMES))
        return model(batch, pool, req_to_token, max_rows=max_rows, options=options)

    return GraphRunner(step, make_static_inputs, max_batch, invalidate_fn=pool.invalidate_loc_cache,
                       options=options, pad_values=PAD_VALUES)
