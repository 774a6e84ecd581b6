"""KVCacheSpec, the byte footprint (checked by hand on the Flash and Pro shapes), the pool's
layout, layer mapping, state rings, and a layer's SWA cache as the set-KV kernels write it."""

import pytest
import torch
from mem_pool_testlib import FLASH_RATIOS, PRO_RATIOS, small_pool

import hip_kernels
from hip_kernels import kv_layout
from mem_pool import KVCacheSpec, footprint


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match=r"compress_ratios entries must be in \(0, 4, 128\)"):
        KVCacheSpec((0, 5))
    with pytest.raises(ValueError, match="head_dim must be 512"):
        KVCacheSpec((0,), head_dim=256)
    with pytest.raises(ValueError, match="start_layer=3, end_layer=2"):
        KVCacheSpec((0, 0, 0, 0), start_layer=3, end_layer=2)
    spec = KVCacheSpec(FLASH_RATIOS, end_layer=43)
    assert spec.window_size == 128 and spec.index_head_dim == 128 and len(spec.layer_ids) == 43


# Bytes by hand (SPEC section 3): page_bytes(P) = ceil(P*584/576)*576.
#   page_bytes(256) = 260*576 = 149760; page_bytes(64) = 65*576 = 37440; page_bytes(2) = 1728;
#   indexer page of 64 rows = 64*132 = 8448.
# State per request: C4 = 8 rows * (2048 + 512) floats * 4 B = 81920; C128 = 128*1024*4 = 524288.
@pytest.mark.parametrize("ratios, layers, c4, c128", [(FLASH_RATIOS, 43, 21, 20),
                                                      (PRO_RATIOS, 61, 30, 31)])
def test_footprint_of_the_flash_and_pro_shapes(ratios, layers, c4, c128):
    spec = KVCacheSpec(ratios, end_layer=layers)
    assert (len(spec.layers_with_ratio(4)), len(spec.layers_with_ratio(128))) == (c4, c128)
    fp = footprint(spec, 256)
    assert fp.swa_page_bytes == layers * 149760
    assert fp.full_page_bytes == c4 * (37440 + 8448) + c128 * 1728
    assert fp.state_bytes_per_request == c4 * 81920 + c128 * 524288
    assert fp.state_bytes_per_request == {43: 12206080, 61: 18710528}[layers]


def test_tokens_that_fit_a_byte_budget():
    fp = footprint(KVCacheSpec(FLASH_RATIOS, end_layer=43), 256)
    # fixed part: 5 SWA pages (4 + page 0), 9 request slots (8 + scratch), full page 0
    fixed = 5 * 6439680 + 9 * 12206080 + 998208
    assert fp.total_bytes(0, 1024, 8) == fixed == 143051328
    budget = fixed + 10 * 998208 + 998207           # one byte short of an 11th page
    assert fp.max_total_tokens_for(budget, 1024, 8) == 10 * 256
    assert fp.total_bytes(2560, 1024, 8) <= budget < fp.total_bytes(2816, 1024, 8)
    with pytest.raises(ValueError, match="budget_bytes=100 is below the 143051328 bytes"):
        fp.max_total_tokens_for(100, 1024, 8)


def test_pool_allocates_exactly_its_footprint_with_the_v4_page_layout():
    pool, _ = small_pool((0, 4, 128, 4), full_tokens=256, swa_tokens=256, page_size=128,
                         max_num_reqs=2)
    assert pool.nbytes == footprint(pool.spec, 128).total_bytes(256, 256, 2)
    assert pool.get_swa_cache(0).shape == (3, kv_layout.page_bytes(128))
    assert pool.get_compressed_cache(1).shape == (3, kv_layout.page_bytes(32))
    assert pool.get_indexer_cache(3).shape == (3, 32 * 132)
    assert pool.get_compressed_cache(2).shape == (3, kv_layout.page_bytes(1))
    assert pool.get_compressed_cache(1) is pool.c4_caches[1]
    assert pool.get_compressed_cache(2) is pool.c128_caches[2]
    assert (pool.compressed_page_size(1), pool.compressed_page_size(2)) == (32, 1)
    assert pool.get_compressor_state(1).shape == (3, 8, 2048)
    assert pool.get_compressor_state(2).shape == (3, 128, 1024)
    assert pool.get_indexer_compressor_state(3).shape == (3, 8, 512)
    for state in (pool.get_compressor_state(2), pool.get_indexer_compressor_state(1)):
        half = state.shape[-1] // 2
        assert (state[..., :half] == 0).all() and (state[..., half:] == float("-inf")).all()
    # every buffer, by kind, under its own name (host copies and byte counts walk this map)
    assert pool.all_buffers() == {
        "swa": pool.swa_caches, "c4": pool.c4_caches, "indexer": pool.indexer_caches,
        "c128": pool.c128_caches, "compressor_state": pool.compressor_states,
        "indexer_compressor_state": pool.indexer_compressor_states}


def test_page_size_and_pool_sizes_must_fit_the_layout():
    with pytest.raises(ValueError, match="page_size=64 must be a positive multiple of 128"):
        small_pool((0, 128), full_tokens=256, swa_tokens=256, page_size=64)
    with pytest.raises(ValueError, match="page_size=6 must be a positive multiple of 4"):
        small_pool((0, 4), full_tokens=60, swa_tokens=60, page_size=6)
    with pytest.raises(ValueError, match="max_total_tokens=100 must be a positive multiple of "
                                         "page_size=16"):
        small_pool((0,), full_tokens=100, swa_tokens=64, page_size=16)
    with pytest.raises(ValueError, match="swa_tokens=8 must be a positive multiple"):
        small_pool((0,), full_tokens=64, swa_tokens=8, page_size=16)
    with pytest.raises(ValueError, match="max_num_reqs must be >= 1"):
        small_pool((0,), max_num_reqs=0)


def test_a_pipeline_stage_holds_only_its_layers_under_global_ids(caplog):
    with caplog.at_level("INFO", logger="mem_pool"):
        pool, _ = small_pool((0, 4, 128, 4, 0), page_size=128, full_tokens=128, swa_tokens=128,
                             start_layer=1, end_layer=4)
    said = [r.getMessage() for r in caplog.records if "KV pool" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        "DeepSeek-V4 KV pool: layers 1..3, 128 full + 128 SWA tokens, page 128, 4 request slots")
    assert sorted(pool.swa_caches) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"layer_id=0 is not held by this pool \(layers 1..3\)"):
        pool.get_swa_cache(0)
    with pytest.raises(ValueError, match="layer_id=2 has compress ratio 128: it has no indexer"):
        pool.get_indexer_cache(2)
    with pytest.raises(ValueError, match="layer_id=0 has compress ratio 0: it has no compressed"):
        small_pool((0, 4))[0].get_compressed_cache(0)


def test_clear_compressor_state_resets_only_those_request_slots():
    pool, _ = small_pool((0, 4, 128), page_size=128, full_tokens=128, swa_tokens=128,
                         max_num_reqs=3)
    states = [pool.get_compressor_state(1), pool.get_compressor_state(2),
              pool.get_indexer_compressor_state(1)]
    for s in states:
        assert s.shape[0] == 4                     # 3 request slots + the scratch row of -1
        s.fill_(5.0)
    pool.clear_compressor_state(torch.tensor([1, 2]))
    for s in states:
        half = s.shape[-1] // 2
        assert (s[1:3, :, :half] == 0).all() and (s[1:3, :, half:] == float("-inf")).all()
        assert (s[0] == 5.0).all() and (s[3] == 5.0).all()
    pool.clear_compressor_state([0])               # the first slot is a slot like the others
    for s in states:
        assert (s[0, :, :half] == 0).all() and (s[3] == 5.0).all()
    with pytest.raises(IndexError, match="req_pool_indices holds 3; valid request slots are 0..2"):
        pool.clear_compressor_state([3])
    with pytest.raises(IndexError, match="req_pool_indices holds -1; valid request slots are 0..2"):
        pool.clear_compressor_state([-1])
    with pytest.raises(TypeError, match="req_pool_indices must have dtype"):
        pool.clear_compressor_state([1.0])


def _rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 512, generator=g) * 3).to(torch.bfloat16)


def test_a_kernel_stores_into_a_layers_swa_cache_at_the_translated_slots():
    """The pool's SWA cache, its translated slots and its page_size are what the set-KV kernels
    take (as the model's window store passes them): the bytes are those of the layout's own
    encoder at those slots, and no other layer's cache changes."""
    pool, al = small_pool((0, 4), full_tokens=64, swa_tokens=64, page_size=16)
    swa_loc = pool.get_cached_swa_loc(al.alloc(16)[3:9], 0)
    rows = _rows(6)
    expected = pool.get_swa_cache(1).clone()
    nope, rope, scales = kv_layout.quantize_kv_rows(
        rows, hip_kernels.DEFAULT_KERNEL_OPTIONS.fp8_dialect)
    kv_layout.write_kv_bytes(expected, swa_loc, 16, *kv_layout.pack_kv_bytes(nope, rope, scales))
    hip_kernels.fused_store_cache(rows, pool.get_swa_cache(1), swa_loc, pool.page_size)
    assert torch.equal(pool.get_swa_cache(1), expected)
    assert pool.get_swa_cache(1).any() and not pool.get_swa_cache(0).any()


def test_a_slot_past_the_pools_swa_slots_is_refused_before_any_cache_byte_changes():
    """32 SWA tokens in pages of 16, plus the dummy page 0: slots 0..47."""
    pool, _ = small_pool((0,), full_tokens=64, swa_tokens=32, page_size=16)
    cache = pool.get_swa_cache(0)
    assert cache.shape[0] * pool.page_size == 48
    with pytest.raises(IndexError, match="out_loc holds location 48"):
        hip_kernels.fused_store_cache(_rows(2), cache, torch.tensor([17, 48], dtype=torch.int32),
                                      pool.page_size)
    assert not cache.any()
