"""The attention prepare step: both paths fetch SWA slots through the pool's cached translation,
give identical results, and a decode step translates once for all layers when the cache is on."""

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.model import DeepseekV4DecoderLayer
from tiny_model import tiny_model

TINY = ModelConfig.preset("tiny")
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 6, 7, 8, 9] * 27, [1, 2, 3]]       # 135 tokens (past the window) and 3
STEPS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=256, seed=2)


def watch_steps(engine, monkeypatch):
    """Per forward step: (mode, layer ids that called get_cached_swa_loc, translations, hits)."""
    pool, steps, calls = engine.pool, [], []
    get = pool.get_cached_swa_loc

    def spy_get(loc, layer_id=None):
        calls.append((layer_id, loc))
        return get(loc, layer_id)

    forward = engine.forward

    def spy_forward(batch, all_logits=False):
        calls.clear()
        t0, h0 = pool.swa_loc_stats.translations, pool.swa_loc_stats.hits
        out = forward(batch, all_logits)
        assert all(loc is batch.out_cache_loc for _, loc in calls)
        steps.append((batch.forward_mode.value, [layer for layer, _ in calls],
                      pool.swa_loc_stats.translations - t0, pool.swa_loc_stats.hits - h0))
        return out

    monkeypatch.setattr(pool, "get_cached_swa_loc", spy_get)
    monkeypatch.setattr(engine, "forward", spy_forward)
    return steps


@pytest.mark.parametrize("multi_stream", ["0", "1"])
@pytest.mark.parametrize("cache", ["1", "0"])
def test_each_prepare_path_uses_the_cached_translation(model, monkeypatch, flag_env, multi_stream,
                                                       cache):
    flag_env(DSV4_MULTI_STREAM_PREPARE=multi_stream, DSV4_CACHE_SWA_TRANSLATION=cache)
    engine = Engine(model, max_batch=2, max_context_len=256, graph=False)
    steps = watch_steps(engine, monkeypatch)
    paths = []
    for name in ("_forward_prepare", "_forward_prepare_multi_stream_hip"):
        def spy(self, *args, _name=name, _f=getattr(DeepseekV4DecoderLayer, name)):
            paths.append(_name)
            return _f(self, *args)
        monkeypatch.setattr(DeepseekV4DecoderLayer, name, spy)
    engine.generate(PROMPTS, STEPS)
    want = "_forward_prepare_multi_stream_hip" if multi_stream == "1" else "_forward_prepare"
    assert paths == [want] * (TINY.n_layers * STEPS)
    assert [mode for mode, *_ in steps] == ["extend"] + ["decode"] * (STEPS - 1)
    layers = list(range(TINY.n_layers))
    for mode, called, translations, hits in steps:
        assert called == layers                     # every layer, in order, once
        if cache == "1":
            assert (translations, hits) == (1, TINY.n_layers - 1), mode
        else:
            assert (translations, hits) == (TINY.n_layers, 0), mode


def test_multi_stream_prepare_gives_identical_results(model, flag_env):
    out = {}
    for flag in ("0", "1"):
        flag_env(DSV4_MULTI_STREAM_PREPARE=flag)
        engine = Engine(model, max_batch=2, max_context_len=256, graph=False)
        out[flag] = engine.generate(PROMPTS, STEPS, return_logits=True)
    assert out["0"].tokens == out["1"].tokens
    assert torch.equal(out["0"].logits, out["1"].logits)


def test_a_layer_binds_its_caches_once_per_pool(model, monkeypatch):
    """The layer's LayerCaches are made when it first sees a pool and reused at every step with
    that pool; another pool (a second engine on the same model) binds its own, and going back
    rebinds the first's buffers."""
    from dsv4 import paged_attention

    made = []
    of = paged_attention.LayerCaches.of

    def spy_of(pool, layer_id, ratio):
        made.append((id(pool), layer_id))
        return of(pool, layer_id, ratio)

    monkeypatch.setattr(paged_attention.LayerCaches, "of", staticmethod(spy_of))
    first, second = (Engine(model, max_batch=2, max_context_len=256, graph=False)
                     for _ in range(2))
    first.generate(PROMPTS, STEPS)
    assert made == [(id(first.pool), i) for i in range(TINY.n_layers)]
    second.generate(PROMPTS, STEPS)
    first.generate(PROMPTS[:1], 2)
    assert len(made) == 3 * TINY.n_layers
    layer = model.layers[1]
    assert layer._bound_caches(first.pool).swa is first.pool.get_swa_cache(1)
