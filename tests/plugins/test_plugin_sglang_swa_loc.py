"""The plugin's replacement of the start_layer-rule `get_cached_swa_loc` (SGLang's 0.5.12 line)
by the identity-keyed cache, applied with SGLang's real HookRegistry to a replica of that API."""

import pytest
import torch

from sglang_host import use_stubs

use_stubs()
pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (see README)")

from hip_kernels.capture import set_emulated_capture  # noqa: E402
from dsv4.plugins import sglang as plugin  # noqa: E402
from dsv4.plugins.swa_loc_adapter import cached_swa_loc_hook, swa_loc_cache_of  # noqa: E402
from start_layer_rule_pool import StartLayerRulePool  # noqa: E402

TARGET = "start_layer_rule_pool.StartLayerRulePool.get_cached_swa_loc"


def mapping():
    m = torch.zeros(65, dtype=torch.int64)
    m[:64] = torch.arange(64) + 100
    m[64] = -1                       # translating -1 gives -1
    return m


@pytest.fixture(scope="module")
def patched_class():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    stock = StartLayerRulePool.get_cached_swa_loc
    HookRegistry.register(TARGET, cached_swa_loc_hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    assert StartLayerRulePool.get_cached_swa_loc.__wrapped__ is stock
    yield StartLayerRulePool
    StartLayerRulePool.get_cached_swa_loc = stock
    HookRegistry._hooks.pop(TARGET)
    HookRegistry._patched.discard(TARGET)


def stock_pool():
    pool = StartLayerRulePool(mapping())
    pool.get_cached_swa_loc = StartLayerRulePool.get_cached_swa_loc.__wrapped__.__get__(pool)
    return pool


def test_plan_detects_the_api_by_feature():
    methods = plugin.class_methods(plugin.POOL_MODULE, plugin.POOL_CLASS)
    assert "get_cached_swa_loc" not in plugin.plan(methods)[0]      # 0.5.23 has none
    legacy = dict(methods, get_cached_swa_loc=("self", "raw_loc", "layer_id"))
    assert "get_cached_swa_loc" in plugin.plan(legacy)[0]
    odd = dict(methods, get_cached_swa_loc=("self", "loc"))
    assert plugin.plan(odd) == ({}, "DeepSeekV4TokenToKVPool.get_cached_swa_loc('self', 'loc') "
                                    "differs from the expected ('self', 'raw_loc', 'layer_id')")


def test_interleaved_micro_batches(patched_class):
    a, b = torch.tensor([1, 2, 3]), torch.tensor([7, 8])
    for pool, stale in ((stock_pool(), True), (patched_class(mapping()), False)):
        pool.get_cached_swa_loc(a, 0)
        pool.get_cached_swa_loc(b, 0)                  # the second micro-batch's layer 0
        got = pool.get_cached_swa_loc(a, 1)            # back to the first one's layer 1
        assert torch.equal(got, mapping()[b] if stale else mapping()[a])


def test_forward_not_starting_at_start_layer(patched_class):
    """A draft or pipeline-stage forward whose first layer is not start_layer."""
    first, second = torch.tensor([4, 5]), torch.tensor([9, -1])
    for pool, stale in ((stock_pool(), True), (patched_class(mapping()), False)):
        pool.get_cached_swa_loc(first, 0)
        got = pool.get_cached_swa_loc(second, 3)
        assert torch.equal(got, mapping()[first] if stale else torch.tensor([109, -1]))


def test_mapping_rewritten_in_place_and_one_translation_per_step(patched_class):
    pool = patched_class(mapping())
    loc = torch.tensor([10, 11])
    for layer in range(4):
        pool.get_cached_swa_loc(loc, layer)
    assert swa_loc_cache_of(pool).stats.translations == 1
    pool.full_to_swa_index_mapping[10] = 0            # freed mid-forward, in place
    assert pool.get_cached_swa_loc(loc, 4).tolist() == [0, 111]
    assert swa_loc_cache_of(pool).stats.translations == 2


def test_capture_always_records_the_gather(patched_class):
    pool = patched_class(mapping())
    loc = torch.tensor([1, 2])
    pool.get_cached_swa_loc(loc, 0)                    # warm-up run
    set_emulated_capture(True)
    try:
        pool.get_cached_swa_loc(loc, 0)
        pool.get_cached_swa_loc(loc, 1)
    finally:
        set_emulated_capture(False)
    # the warm-up entry did not serve the capture: one more gather, shared by its layers
    assert swa_loc_cache_of(pool).stats.translations == 2
