"""The engine with a prefix cache: a prompt sharing a prefix with an earlier one loads the cached
pages instead of prefilling them, and its logits are those of a run without the cache, for
prefixes shorter than a window, ending at a page boundary, ending inside the window and longer
than the window plus a page; short prefetches (a page's SWA rows missing, a corrupt file) fall
back to an earlier commit point; nothing leaks; the flag (the CLI's --prefix-cache --repeat:
tests/runtime/test_runtime_cli.py)."""

import dataclasses
import logging

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.model import DeepseekV4Model
from dsv4.options import Options
from dsv4.random_init import init_random_weights
from hip_kernels import flags
from mem_pool.prefix.file_page_store import PAGE_SUFFIX
from mem_pool.prefix.page_record import KV
from mem_pool.prefix import PrefixCache

# A window of two pages, so that a one-page prefix is shorter than the window.
CONFIG = dataclasses.replace(ModelConfig.preset("tiny"), window_size=256)
PAGE, WINDOW, MAX_LEN, STEPS = 128, 256, 640, 4
# The engine's eager-vs-graph tolerance (tests/runtime/test_runtime_graphs.py).
LOGIT_ATOL = 0.1


@pytest.fixture(scope="module")
def model():
    return init_random_weights(DeepseekV4Model(CONFIG, max_seq_len=MAX_LEN), seed=3)


def ids(n, seed):
    return torch.randint(2, CONFIG.vocab_size, (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


BASE = ids(600, seed=11)


def engine(model, cache, graph=False, options=None):
    return Engine(model, page_size=PAGE, max_batch=2, max_context_len=MAX_LEN, graph=graph,
                  prefix_cache=cache, options=options)


def assert_nothing_held(e: Engine):
    a = e.allocator
    assert a.full_available_size() == a.size_full and a.swa_available_size() == a.size_swa
    if e.prefix_cache is not None:
        assert e.prefix_cache.host.pinned_pages() == 0


@pytest.fixture(scope="module")
def without_cache(model):
    """Logits and tokens of a prompt run on an engine with no cache, with the options the
    calling test's flags give (an engine reads them when made: one engine per options),
    memoized."""
    engines, memo = {}, {}

    def run(prompt):
        options = Options.from_env()
        if options not in engines:
            engines[options] = engine(model, False, options=options)
        key = (tuple(prompt), options)
        if key not in memo:
            memo[key] = engines[options].generate([prompt], STEPS, return_logits=True)
        return memo[key]
    return run


@pytest.fixture(scope="module")
def pages_of(model):
    """The pages an earlier prompt's prefill leaves in a cache, {key: record}, memoized: tests
    that start from the same earlier prompt share its prefill (``cache_holding`` starts a fresh
    cache from a copy)."""
    memo = {}

    def run(prompt):
        if tuple(prompt) not in memo:
            cache = PrefixCache(PAGE, WINDOW, host_capacity_pages=16)
            engine(model, cache).generate([prompt], 1)
            memo[tuple(prompt)] = {key: cache.host.get(key) for key in cache.host.keys()}
        return memo[tuple(prompt)]
    return run


def cache_holding(pages: dict, **kwargs) -> PrefixCache:
    """A fresh cache given a copy of `pages` as the engine gives them (insert; with a file_dir,
    written to the file tier too)."""
    cache = PrefixCache(PAGE, WINDOW, host_capacity_pages=16, **kwargs)
    for key, record in pages.items():
        cache.insert(key, {name: t.clone() for name, t in record.items()})
    return cache


SHAPES = {  # name: (earlier prompt, later prompt, tokens the later one takes from the cache)
    "shorter-than-window": (BASE[:200], BASE[:150] + ids(40, 1), 128),
    "at-page-boundary": (BASE[:300], BASE[:256] + ids(30, 2), 256),
    "inside-window": (BASE[:420], BASE[:330] + ids(30, 3), 256),
    "longer-than-window-plus-page": (BASE[:540], BASE[:520] + ids(20, 4), 512),
}


# Every shape eagerly; under graphs the longest (a restored prefix is graphed as any other:
# the replayed step gives eager's bits, tests/runtime/test_graph_eager_bits.py).
CASES = [*((shape, False) for shape in SHAPES), ("longer-than-window-plus-page", True)]


@pytest.mark.parametrize("shape,graph", CASES,
                         ids=[f"{s}-{'graph' if g else 'eager'}" for s, g in CASES])
def test_a_cached_prefix_gives_the_logits_of_a_full_prefill(model, without_cache, pages_of,
                                                             shape, graph):
    earlier, later, hit = SHAPES[shape]
    e = engine(model, cache_holding(pages_of(earlier)), graph)
    got = e.generate([later], STEPS, return_logits=True)
    want = without_cache(later)
    assert e.stats.prefix_hit_tokens == hit and e.stats.prompt_tokens == len(later)
    assert got.tokens == want.tokens
    assert (got.logits - want.logits).abs().max() <= LOGIT_ATOL
    assert_nothing_held(e)


def test_a_batch_mixing_hits_and_misses(model, without_cache, flag_env):
    """Each request of a mixed batch against itself alone: batch-composition stability, so in
    DSV4_NUMERICS=fp32 (the reference's roundings make a request depend on its batch)."""
    flag_env(DSV4_NUMERICS="fp32")
    cache = PrefixCache(PAGE, WINDOW, host_capacity_pages=16)
    e = engine(model, cache)
    e.generate([BASE[:400]], 1)
    prompts = [BASE[:300] + ids(10, 5), ids(200, 6)]
    got = e.generate(prompts, STEPS, return_logits=True)
    for i, prompt in enumerate(prompts):
        want = without_cache(prompt)
        assert got.tokens[i] == want.tokens[0]
        assert (got.logits[i] - want.logits[0]).abs().max() <= LOGIT_ATOL
    assert e.stats.prefix_hit_tokens == 256
    # the cache's own counters: one lookup per request (3), each of its prompt but the last
    # token (a prompt is never taken whole from the cache)
    s = cache.stats
    assert (s.lookups, s.lookup_tokens, s.hit_tokens) == (3, 399 + 309 + 199, 256)
    assert s.hit_rate == 256 / 907
    assert_nothing_held(e)


def test_the_ratio4_rings_are_restored_at_the_commit_point(model):
    """The compressor rings a hit loads equal the rings a full prefill leaves at that point."""
    prompt = BASE[:256]
    plain = engine(model, False)
    plain.generate([prompt + [5]], 1)
    cache = PrefixCache(PAGE, WINDOW, host_capacity_pages=16)
    cached = engine(model, cache)
    cached.generate([prompt + [7]], 1)           # caches pages 0 and 1 (rings at 256)
    hit = cache.match(prompt + [9], max_tokens=256)
    assert hit.tokens == 256
    for table, layers in hit.copy.states.items():
        assert layers, table
        for layer, ring in layers.items():
            full = getattr(plain.pool, table == "compressor_state" and "compressor_states"
                           or "indexer_compressor_states")[layer]
            # The plain run's ring after prompt + [5] holds position 256 at row 0; rows 1..7
            # are positions 249..255, as at the boundary.
            assert torch.equal(ring[1:], full[1, 1:]), (table, layer)


def strip_swa(cache: PrefixCache, key: str):
    record = cache.host.get(key)
    for name in list(record):
        if name.startswith(f"{KV}/swa/"):
            record[name] = (torch.zeros_like(record[name]) if name.endswith("mask")
                            else record[name][:0])


def test_a_page_without_its_swa_rows_moves_the_commit_point_back(model, without_cache,
                                                                  pages_of):
    """Page 3's SWA rows are gone: committing 512 would need them (window [256, 512)), so the
    request commits 384 (window pages 1, 2) and releases what it fetched beyond."""
    cache = cache_holding(pages_of(BASE[:540]))
    e = engine(model, cache)
    strip_swa(cache, cache.keys(BASE)[3])
    later = BASE[:520] + ids(20, 4)
    got = e.generate([later], STEPS, return_logits=True)
    want = without_cache(later)
    assert cache.stats.short_prefetches == 1 and cache.stats.released_pages == 1
    assert e.stats.prefix_hit_tokens == 384
    assert got.tokens == want.tokens
    assert (got.logits - want.logits).abs().max() <= LOGIT_ATOL
    assert_nothing_held(e)


def test_the_file_tier_survives_a_restart_and_a_corrupt_page_is_a_logged_miss(
        model, without_cache, pages_of, tmp_path, caplog):
    first = cache_holding(pages_of(BASE[:540]), file_dir=tmp_path)
    assert len(list(tmp_path.glob("*" + PAGE_SUFFIX))) == 4
    later = BASE[:520] + ids(20, 4)
    want = without_cache(later)

    restarted = PrefixCache(PAGE, WINDOW, host_capacity_pages=16, file_dir=tmp_path)
    e = engine(model, restarted)
    got = e.generate([later], STEPS, return_logits=True)
    assert e.stats.prefix_hit_tokens == 512 and restarted.stats.file_page_hits == 4
    assert got.tokens == want.tokens

    page2 = tmp_path / (first.keys(BASE)[2] + PAGE_SUFFIX)
    page2.write_bytes(page2.read_bytes()[:-100])     # torn
    again = PrefixCache(PAGE, WINDOW, host_capacity_pages=16, file_dir=tmp_path)
    e = engine(model, again)
    with caplog.at_level(logging.WARNING, logger="mem_pool"):
        got = e.generate([later], STEPS, return_logits=True)
    assert page2.name[:12] in caplog.text or first.keys(BASE)[2][:12] in caplog.text
    assert e.stats.prefix_hit_tokens == 256           # pages 0, 1: page 2 missing
    assert got.tokens == want.tokens
    assert (got.logits - want.logits).abs().max() <= LOGIT_ATOL
    assert_nothing_held(e)


def test_a_prompt_is_never_taken_whole_from_the_cache(model):
    """The last prompt token is always computed: its logits give the first new token."""
    cache = PrefixCache(PAGE, WINDOW, host_capacity_pages=16)
    e = engine(model, cache)
    e.generate([BASE[:256]], 1)
    e.generate([BASE[:256]], 2)
    assert e.stats.prefix_hit_tokens == 128


def test_the_flag_builds_a_cache_and_a_mismatched_cache_is_refused(model, monkeypatch,
                                                                    tmp_path):
    monkeypatch.setenv("DSV4_PREFIX_CACHE", "1")
    monkeypatch.setenv("DSV4_PREFIX_CACHE_DIR", str(tmp_path))
    flags.refresh()
    try:
        e = engine(model, None)
        assert isinstance(e.prefix_cache, PrefixCache)
        assert e.prefix_cache.file.directory == tmp_path
        assert engine(model, False).prefix_cache is None
    finally:
        monkeypatch.delenv("DSV4_PREFIX_CACHE")
        monkeypatch.delenv("DSV4_PREFIX_CACHE_DIR")
        flags.refresh()
    assert engine(model, None).prefix_cache is None              # off by default
    with pytest.raises(ValueError, match="prefix_cache holds pages of 256 tokens"):
        engine(model, PrefixCache(256, WINDOW, host_capacity_pages=4))
