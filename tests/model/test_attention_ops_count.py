"""The attention half of a decode layer in at most ATTENTION_BUDGET dispatcher ops (issue 26): a
tiny-preset eager decode step, batch 1 and 8, counted per layer (each layer's PagedAttention call:
Q/KV projections and store, compressors, indexer, attention, output projection; not mHC or the
norm before it); the step's metadata (shared by every layer) is one op."""

import sys

import pytest
import torch

import dsv4.model as model_module
from bench_runner import SCRIPTS
from dsv4.engine import Engine
from dsv4.paged_attention import PagedAttention
from tiny_model import tiny_model

sys.path.insert(0, str(SCRIPTS))
import bench_common as bc  # noqa: E402  (the benchmark's counter: no views, no allocations)

# One layer's attention half: 18 ops on a ratio-4 layer (q 3, kv + store 2, compressors 2 + 2,
# indexer 6, attention 1, output 2; the ops read the RoPE table at the positions themselves),
# and the two compressed-row stores of a step that closes a window.
ATTENTION_BUDGET = 22


def _ops(fn) -> tuple[int, object]:
    out = []
    return bc.count_dispatcher_ops(lambda: out.append(fn())).launches, out[0]


@pytest.mark.parametrize("batch", [1, 8])
def test_attention_half_fits_its_budget(monkeypatch, batch):
    model = tiny_model(256, seed=0)
    layers = model.config.n_layers
    counts, meta_ops, steps = [], [], []
    real_call, real_meta = PagedAttention.__call__, model_module.build_attention_metadata

    def counted_call(self, *args, **kwargs):
        n, out = _ops(lambda: real_call(self, *args, **kwargs))
        counts.append(n)
        return out

    def counted_meta(*args, **kwargs):
        n, out = _ops(lambda: real_meta(*args, **kwargs))
        meta_ops.append(n)
        return out

    engine = Engine(model, max_batch=batch, max_context_len=64, page_size=128, graph=False)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(2, model.config.vocab_size, (batch, 6), generator=g).tolist()
    real_step = engine._decode_step

    def step(*args):
        monkeypatch.setattr(PagedAttention, "__call__", counted_call)
        monkeypatch.setattr(model_module, "build_attention_metadata", counted_meta)
        try:
            return real_step(*args)
        finally:
            monkeypatch.setattr(PagedAttention, "__call__", real_call)
            monkeypatch.setattr(model_module, "build_attention_metadata", real_meta)
            steps.append((list(counts), list(meta_ops)))
            counts.clear()
            meta_ops.clear()

    engine._decode_step = step
    engine.generate(prompts, 4)      # decode positions 6, 7 (closes a ratio-4 window), 8
    assert len(steps) == 3
    for per_layer, meta in steps:
        assert len(per_layer) == layers and len(meta) == 1
        assert max(per_layer) <= ATTENTION_BUDGET and meta == [1], (per_layer, meta)
