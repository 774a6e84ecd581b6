"""The engine's decode graphs (CPU emulation): replay equals eager decode token for token and
logit for logit, padded rows write only the dummy page, one SWA gather per graph, the capture-time
invalidation matters, capture repeats, and a replay with other step options is refused."""

import dataclasses

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.graphs import GraphFlagChanged
from dsv4.options import Options
from tiny_model import tiny_model
from hip_kernels.kv_layout import VALUE_BYTES

TINY = ModelConfig.preset("tiny")
MAX_LEN, STEPS, SENTINEL = 192, 5, 0xA5
# A captured step attends over a static number of compressed rows (model.static_max_rows) and a
# padded graph runs its GEMMs on more rows than the live batch; both change fp32 summation order,
# so logits agree to test_model_paged's LOGIT_ATOL (measured worst here ~0.015), tokens exactly.
LOGIT_ATOL = 0.1


@pytest.fixture(autouse=True)
def fp32_numerics(flag_env):
    """Replay vs eager within LOGIT_ATOL and equal tokens is a property of DSV4_NUMERICS=fp32;
    with the reference's bf16 roundings a padded graph's batch can flip a near-tied top-k pick
    (test_numerics_reference holds what is true there: replay equals eager on the same batch)."""
    flag_env(DSV4_NUMERICS="fp32")


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=MAX_LEN, seed=1)


@pytest.fixture(scope="module")
def engines(model):
    """(eager, graph) engines for batches up to 8: graphs 1, 2, 4, 8 captured once. Made before
    the fp32 flag above is set (a module fixture), so they are given fp32 options."""
    fp32 = Options(numerics="fp32")
    return (Engine(model, max_batch=8, max_context_len=MAX_LEN, graph=False, options=fp32),
            Engine(model, max_batch=8, max_context_len=MAX_LEN, graph=True, options=fp32))


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TINY.vocab_size, (20 + 9 * i,), generator=g).tolist()
            for i in range(n)]


def kv_caches(pool):
    """Every paged KV byte tensor of the pool (SWA, C4, indexer, C128), page 0 first."""
    return [c for table in (pool.swa_caches, pool.c4_caches, pool.indexer_caches,
                            pool.c128_caches) for c in table.values()]


@pytest.mark.parametrize("n", [1, 3, 5], ids=["1", "3-padded-to-4", "5-padded-to-8"])
def test_replayed_decode_equals_eager_decode(engines, n):
    eager, graph = engines
    want = eager.generate(prompts(n), STEPS, return_logits=True)
    steps_before = graph.stats.graph_steps
    got = graph.generate(prompts(n), STEPS, return_logits=True)
    assert graph.stats.graph_steps - steps_before == STEPS - 1
    assert got.tokens == want.tokens
    assert (got.logits - want.logits).abs().max() <= LOGIT_ATOL


def written_swa_rows(pool):
    """[layers, pages, page_size] bool: SWA rows whose value bytes left the sentinel."""
    rows = [c[:, :pool.page_size * VALUE_BYTES].view(c.shape[0], pool.page_size, VALUE_BYTES)
            for c in pool.swa_caches.values()]
    return torch.stack([(r != SENTINEL).any(-1) for r in rows])


def test_padded_rows_write_only_the_dummy_page(model):
    """Both engines start from sentinel SWA caches; after the same generation the graph engine
    wrote exactly the SWA rows eager decode wrote, plus rows of page 0 (the padded row's)."""
    eager, graph = (Engine(model, max_batch=4, max_context_len=MAX_LEN, graph=g)
                    for g in (False, True))
    for engine in (eager, graph):
        for cache in engine.pool.swa_caches.values():
            cache.fill_(SENTINEL)
        engine.generate(prompts(3), STEPS)          # 3 rows replay the graph of 4
    want, got = written_swa_rows(eager.pool), written_swa_rows(graph.pool)
    assert want[:, 1:].any() and torch.equal(got[:, 1:], want[:, 1:])
    assert not want[:, 0].any() and got[:, 0].any()


def swa_gathers(graph, pool, out_cache_loc):
    """Recorded gathers through the full->SWA mapping indexed by the static out_cache_loc."""
    mapping = pool.full_to_swa_index_mapping
    loc_storage = out_cache_loc.untyped_storage().data_ptr()
    return sum(1 for op in graph.ops if op.func.overloadpacket is torch.ops.aten.index
               and op.args[0] is mapping and isinstance(op.args[1][0], torch.Tensor)
               and op.args[1][0].untyped_storage().data_ptr() == loc_storage)


def test_each_captured_graph_contains_one_swa_gather(engines):
    _, graph = engines
    graph.generate(prompts(2), 2)                    # captures, if no test did yet
    runner = graph.graph_runner
    assert sorted(runner.graphs) == list(range(1, 9))          # one graph per batch size
    for bs, g in runner.graphs.items():
        assert swa_gathers(g, graph.pool, runner.static["out_cache_loc"]) == 1, bs


@pytest.mark.parametrize("invalidate", [True, False], ids=["invalidated", "not-invalidated"])
def test_skipping_the_capture_invalidation_replays_stale_slots(model, monkeypatch, invalidate):
    """With a location cache that does not key on capture (as a naive one would), the warm-up's
    translation of the padded static buffer (the dummy slot) is a hit in the capture run unless
    the runner invalidates: the graph then never gathers and writes every row's KV to slot 0."""
    import mem_pool.swa_loc_cache as swa_loc_cache

    monkeypatch.setattr(swa_loc_cache, "is_capturing", lambda: False)
    eager = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=False)
    graph = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=True)
    if not invalidate:
        graph.graph_runner.invalidate_fn = lambda: None
    for engine in (eager, graph):
        for cache in engine.pool.swa_caches.values():
            cache.fill_(SENTINEL)
    want = eager.generate(prompts(2), STEPS, return_logits=True)
    got = graph.generate(prompts(2), STEPS, return_logits=True)
    runner = graph.graph_runner
    gathers = [swa_gathers(g, graph.pool, runner.static["out_cache_loc"])
               for g in runner.graphs.values()]
    same_rows = torch.equal(written_swa_rows(eager.pool)[:, 1:],
                            written_swa_rows(graph.pool)[:, 1:])
    diff = (got.logits - want.logits).abs().max()
    if invalidate:
        assert gathers == [1, 1] and same_rows and diff <= LOGIT_ATOL
    else:
        assert gathers == [0, 0] and not same_rows and not diff <= LOGIT_ATOL  # NaN too


def test_capturing_twice_in_one_process_replays_correctly(model, engines):
    eager, _ = engines
    want = eager.generate(prompts(3, seed=4), STEPS)
    graph = Engine(model, max_batch=4, max_context_len=MAX_LEN, graph=True)
    assert graph.generate(prompts(3, seed=4), STEPS).tokens == want.tokens
    first = dict(graph.graph_runner.graphs)
    graph.graph_runner.capture()
    assert all(graph.graph_runner.graphs[bs] is not first[bs] for bs in first)
    assert graph.generate(prompts(3, seed=4), STEPS).tokens == want.tokens


def test_changing_the_step_options_after_capture_raises(model, flag_env):
    """The engine reads the flags once, when made: a flag set afterwards changes nothing; other
    step options after capture are refused (naming the field) and leak no page."""
    graph = Engine(model, max_batch=1, max_context_len=MAX_LEN, graph=True)
    want = graph.generate(prompts(1), 2).tokens
    flag_env(DSV4_FUSED_SWA_TRANSLATE="1", DSV4_MULTI_STREAM_PREPARE="1")
    assert graph.generate(prompts(1), 2).tokens == want
    captured = graph.options
    graph.options = dataclasses.replace(captured, fused_swa_translate=True)
    with pytest.raises(GraphFlagChanged, match="fused_swa_translate: False -> True"):
        graph.generate(prompts(1), 2)
    assert graph.allocator.full_available_size() == graph.allocator.size_full
    graph.options = captured
    assert graph.generate(prompts(1), 2).tokens == want
