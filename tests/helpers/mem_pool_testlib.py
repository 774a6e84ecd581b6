"""Small pools, model-shaped specs and host-copy checks shared by the mem_pool tests (and the
engine's KV slots test)."""

import torch

from mem_pool import KVCacheSpec, create_dsv4_kv_cache

# SPEC section 1: one ratio per layer, then the MTP layer's 0.
FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)     # 43 layers + MTP
PRO_RATIOS = (128, 128) + (4, 128) * 29 + (4, 0)   # 61 layers + MTP


def small_pool(ratios=(0, 0, 0), full_tokens=64, swa_tokens=32, page_size=4, max_num_reqs=4,
               cache_swa_translation=None, swa_cache_verify=None, **spec_kw):
    """(pool, allocator) of a small spec on the CPU."""
    spec = KVCacheSpec(ratios, **spec_kw)
    return create_dsv4_kv_cache(spec, full_tokens, swa_tokens, page_size, "cpu",
                                max_num_reqs=max_num_reqs,
                                cache_swa_translation=cache_swa_translation,
                                swa_cache_verify=swa_cache_verify)


def expected_swa(allocator, loc: torch.Tensor) -> torch.Tensor:
    """The translation computed from scratch (no cache): mapping[loc] as int32."""
    return allocator.full_to_swa_index_mapping[loc.long()].to(torch.int32)


def fill_random(pool, seed=0):
    """Random bytes (uint8 tables) or normal values in every buffer of the pool."""
    g = torch.Generator().manual_seed(seed)
    for table in pool.all_buffers().values():
        for t in table.values():
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
            else:
                t.copy_(torch.randn(t.shape, generator=g))


def assert_same_copy(a, b):
    """Two host copies hold the same rows, masks and state rings, byte for byte."""
    assert a.num_tokens == b.num_tokens and set(a.families) == set(b.families)
    for family, rows in a.families.items():
        other = b.families[family]
        assert torch.equal(rows.mask, other.mask), family
        assert set(rows.layers) == set(other.layers), family
        for layer, (values, scales) in rows.layers.items():
            assert torch.equal(values, other.layers[layer][0]), (family, layer)
            assert torch.equal(scales, other.layers[layer][1]), (family, layer)
    assert (a.states is None) == (b.states is None)
    for name, layers in (a.states or {}).items():
        for layer, state in layers.items():
            assert torch.equal(state, b.states[name][layer]), (name, layer)
