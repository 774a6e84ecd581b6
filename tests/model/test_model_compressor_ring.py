"""What a forward leaves in the pool's compressor state rings: each kept position's
[x @ wkv^T | x @ wgate^T] (x: the compressor's input, the attn-normed layer input), the raw gate
output without the position bias ape, which the pool adds. SGLang's rings hold the same, so a
ring its prefill wrote is one our decode pools (and back)."""

import pytest
import torch
import torch.nn.functional as F

from dsv4.engine import Engine
from dsv4.forward_batch import ForwardBatch, ForwardMode
from dsv4.layers.compressor import Compressor
from hip_kernels.attention_plan import state_ring_rows
from tiny_model import tiny_model

MAX_LEN, N = 256, 11          # 11 tokens: two ratio-4 windows close, the ring wraps


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=MAX_LEN, seed=1)


def test_the_rings_hold_the_raw_gate_output(model, monkeypatch):
    inputs = {}
    project = Compressor.project

    def recording(self, x, *args, **kwargs):
        inputs[id(self)] = x.clone()
        return project(self, x, *args, **kwargs)

    monkeypatch.setattr(Compressor, "project", recording)
    engine = Engine(model, max_batch=1, max_context_len=MAX_LEN, graph=False)
    slot = engine.req_to_token_pool.alloc()
    engine.pool.clear_compressor_state(torch.tensor([slot]))
    tokens = torch.randint(0, model.config.vocab_size, (N,),
                           generator=torch.Generator().manual_seed(5))
    locs = engine.allocator.alloc_extend(torch.tensor([0]), torch.tensor([N]), torch.tensor([-1]),
                                         N)
    engine.req_to_token_pool.write(slot, 0, locs)
    engine.forward(ForwardBatch(ForwardMode.EXTEND, tokens, torch.arange(N), locs,
                                torch.tensor([slot]), torch.tensor([N]), torch.tensor([N])))
    checked = 0
    for layer in model.layers:
        attn = layer.attn
        rings = [(attn.compressor, engine.pool.compressor_states)]
        if attn.indexer is not None:
            rings.append((attn.indexer.compressor, engine.pool.indexer_compressor_states))
        for comp, table in rings:
            if comp is None:
                continue
            state = table[layer.layer_id]
            x = inputs[id(comp)].float()
            ring = state.shape[1]
            pos = torch.arange(max(N - ring, 0), N)
            kept = state.view(-1, state.shape[-1])[state_ring_rows(torch.tensor(slot), pos, ring)]
            width = kept.shape[1] // 2
            assert torch.equal(kept[:, :width], F.linear(x[pos], comp.wkv.weight))
            assert torch.equal(kept[:, width:], F.linear(x[pos], comp.wgate.weight))
            assert comp.ape.abs().amax() > 0.1       # a ring holding gate + ape would differ
            checked += 1
    assert checked >= 3       # a ratio-4 layer's two compressors and a ratio-128 layer's
