"""The attention prepare step: both paths store at the step's SWA write slots, translated once per
step through the pool's cached translation (in the attention metadata, shared by all layers),
and give identical results."""

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.paged_attention import PagedAttention
from hip_kernels import set_kv
from tiny_model import tiny_model

TINY = ModelConfig.preset("tiny")
PROMPTS = [[5, 6, 7, 8, 9] * 27, [1, 2, 3]]       # 135 tokens (past the window) and 3
STEPS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=256, seed=2)


def watch_steps(engine, monkeypatch):
    """Per forward step: (mode, the layer_id of each get_cached_swa_loc call, translations,
    hits)."""
    pool, steps, calls = engine.pool, [], []
    get = pool.get_cached_swa_loc

    def spy_get(loc, layer_id=None):
        calls.append((layer_id, loc))
        return get(loc, layer_id)

    forward = engine.forward

    def spy_forward(batch, all_logits=False, **kwargs):
        calls.clear()
        t0, h0 = pool.swa_loc_stats.translations, pool.swa_loc_stats.hits
        out = forward(batch, all_logits, **kwargs)
        assert all(loc is batch.out_cache_loc for _, loc in calls)
        steps.append((batch.forward_mode.value, [layer for layer, _ in calls],
                      pool.swa_loc_stats.translations - t0, pool.swa_loc_stats.hits - h0))
        return out

    monkeypatch.setattr(pool, "get_cached_swa_loc", spy_get)
    monkeypatch.setattr(engine, "forward", spy_forward)
    return steps


@pytest.mark.parametrize("multi_stream", ["0", "1"])
@pytest.mark.parametrize("cache", ["1", "0"])
def test_each_prepare_path_stores_at_the_steps_translation(model, monkeypatch, flag_env,
                                                         multi_stream, cache):
    """One translation per step whatever the cache flag (the metadata asks once, for all
    layers), and every layer's store receives that very tensor."""
    flag_env(DSV4_MULTI_STREAM_PREPARE=multi_stream, DSV4_CACHE_SWA_TRANSLATION=cache)
    engine = Engine(model, max_batch=2, max_context_len=256, graph=False)
    steps = watch_steps(engine, monkeypatch)
    paths, stored_at, translated = [], [], []
    for name in ("prepare", "prepare_multi_stream"):
        def spy(self, *args, _name=name, _f=getattr(PagedAttention, name)):
            paths.append(_name)
            return _f(self, *args)
        monkeypatch.setattr(PagedAttention, name, spy)
    store = set_kv.fused_k_norm_rope_store
    translate = engine.pool.get_cached_swa_loc

    def spy_store(kv, weight, eps, freqs_cis, positions, swa_loc, *args, **kwargs):
        stored_at.append(swa_loc)
        return store(kv, weight, eps, freqs_cis, positions, swa_loc, *args, **kwargs)

    def spy_translate(loc, layer_id=None):
        translated.append(translate(loc, layer_id))
        return translated[-1]

    monkeypatch.setattr(set_kv, "fused_k_norm_rope_store", spy_store)
    monkeypatch.setattr(engine.pool, "get_cached_swa_loc", spy_translate)
    engine.generate(PROMPTS, STEPS)
    want = "prepare_multi_stream" if multi_stream == "1" else "prepare"
    assert paths == [want] * (TINY.n_layers * STEPS)
    assert [mode for mode, *_ in steps] == ["extend"] + ["decode"] * (STEPS - 1)
    for mode, called, translations, hits in steps:
        assert called == [None], mode               # once per step, not per layer
        assert (translations, hits) == (1, 0), mode
    assert len(translated) == STEPS and len(stored_at) == TINY.n_layers * STEPS
    for i, slots in enumerate(stored_at):
        assert slots is translated[i // TINY.n_layers]


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
    assert layer.paged.caches(first.pool).swa is first.pool.get_swa_cache(1)


def test_the_write_slot_is_the_windows_newest_row(model, monkeypatch):
    """The metadata's write slot (the pool's translation of out_cache_loc) is the SWA slot that
    req_to_token -> full_to_swa gives for each token's own position: the window's last row."""
    import dsv4.model as dm

    build, metas = dm.build_attention_metadata, []

    def spy(batch, req_to_token, full_to_swa, *args, **kwargs):
        meta = build(batch, req_to_token, full_to_swa, *args, **kwargs)
        rows = batch.req_pool_indices.long()[batch.token_request_rows()]
        full = req_to_token[rows, batch.positions.long()].long()
        metas.append((meta, full_to_swa[full].clone(), batch.out_cache_loc.clone()))
        return meta

    monkeypatch.setattr(dm, "build_attention_metadata", spy)
    Engine(model, max_batch=2, max_context_len=256, graph=False).generate(PROMPTS, STEPS)
    assert len(metas) == STEPS
    for meta, want, out_loc in metas:
        assert torch.equal(meta.swa_write_loc.long(), want.long())
        assert torch.equal(meta.window_loc[:, -1].long(), want.long())
        assert bool(meta.window_valid[:, -1].all())
        assert meta.swa_write_loc.shape == out_loc.shape


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_the_fused_translating_store_gives_the_same_bits(model, monkeypatch, flag_env, graph):
    """DSV4_FUSED_SWA_TRANSLATE=1: every layer's store translates out_cache_loc inside the
    kernel (the pool's translation is never asked) and the logits are the default's, bit for
    bit, eager and under decode graphs."""
    out = {}
    fused = set_kv.fused_translate_norm_rope_store
    for flag in ("0", "1"):
        flag_env(DSV4_FUSED_SWA_TRANSLATE=flag)
        engine = Engine(model, max_batch=2, max_context_len=256, graph=graph)
        calls = {"translate": 0, "fused": 0}
        translate = engine.pool.get_cached_swa_loc

        def spy_translate(*a, **k):
            calls["translate"] += 1
            return translate(*a, **k)

        def spy_fused(*a, **k):
            calls["fused"] += 1
            return fused(*a, **k)

        monkeypatch.setattr(engine.pool, "get_cached_swa_loc", spy_translate)
        monkeypatch.setattr(set_kv, "fused_translate_norm_rope_store", spy_fused)
        out[flag] = engine.generate(PROMPTS, STEPS, return_logits=True)
        if flag == "1":
            assert calls["translate"] == 0 and calls["fused"] >= TINY.n_layers
        else:
            assert calls["translate"] >= 1 and calls["fused"] == 0
    assert out["0"].tokens == out["1"].tokens
    assert torch.equal(out["0"].logits, out["1"].logits)
