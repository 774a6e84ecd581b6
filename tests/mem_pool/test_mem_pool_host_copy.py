"""Host copies: byte-exact round trips into other slots and in-page offsets; masks that disagree
raise naming the rows, before any byte is written."""

import pytest
import torch
from mem_pool_testlib import assert_same_copy, fill_random, small_pool

import hip_kernels
from hip_kernels import kv_layout


def snapshot(pool):
    return {(name, layer): t.clone() for name, table in pool.all_buffers().items()
            for layer, t in table.items()}


def test_round_trip_into_other_pages_and_in_page_offsets():
    pool, al = small_pool((0, 4, 0, 4), full_tokens=16 * 16, swa_tokens=16 * 16, page_size=16)
    src = al.alloc_extend([0], [37], [-1], 37)
    fill_random(pool)
    copy = pool.get_cpu_copy(src, req_pool_idx=1)
    assert copy.families["c4"].mask.sum() == 9 and copy.families["swa"].mask.all()
    # the copied bytes are the layout's rows: C4 row loc // 4 of every 4th token
    c4_rows = src[3::4] // 4
    values, scales = kv_layout.read_kv_bytes(pool.get_compressed_cache(1), c4_rows, 4)
    assert torch.equal(copy.families["c4"].layers[1][0], values)
    assert torch.equal(copy.families["c4"].layers[1][1], scales)
    q, scale = copy.families["indexer"].layers[3]
    dialect = hip_kernels.DEFAULT_KERNEL_OPTIONS.fp8_dialect
    dequant = q.view(dialect.torch_dtype).float() * scale.view(torch.float32)
    expected = kv_layout.read_indexer_rows(pool.get_indexer_cache(3), c4_rows, 4, dialect)
    assert torch.equal(dequant.nan_to_num(), expected.nan_to_num())
    dst = al.alloc(4 * 16)[4:4 + 37]                 # other pages, in-page offset 4
    pool.load_cpu_copy(copy, dst, req_pool_idx=2)
    assert_same_copy(pool.get_cpu_copy(dst, req_pool_idx=2), copy)
    assert_same_copy(pool.get_cpu_copy(src, req_pool_idx=1), copy)   # the source is untouched


def test_round_trip_with_c128_rows():
    pool, al = small_pool((0, 4, 128), full_tokens=8 * 128, swa_tokens=8 * 128, page_size=128,
                          max_num_reqs=2)
    src = al.alloc_extend([0], [300], [-1], 300)
    fill_random(pool, seed=1)
    copy = pool.get_cpu_copy(src, 0)
    assert copy.families["c128"].mask.sum() == 2
    al.free(src)
    al.alloc(2 * 128)                                  # the request comes back elsewhere
    dst = al.alloc_extend([0], [300], [-1], 300)
    assert not set(dst.tolist()) & set(src.tolist())
    pool.load_cpu_copy(copy, dst, 1)
    assert_same_copy(pool.get_cpu_copy(dst, 1), copy)


def test_only_rows_with_an_swa_slot_are_copied_and_loaded():
    pool, al = small_pool((0, 4), full_tokens=16 * 16, swa_tokens=16 * 16, page_size=16)
    src = al.alloc_extend_swa_tail(40, 8)              # positions 32..39 have SWA slots
    fill_random(pool, seed=2)
    copy = pool.get_cpu_copy(src)
    assert copy.families["swa"].mask.tolist() == [False] * 32 + [True] * 8
    assert copy.families["swa"].layers[0][0].shape == (8, 576)
    dst = al.alloc_extend_swa_tail(40, 8)
    pool.load_cpu_copy(copy, dst)
    assert_same_copy(pool.get_cpu_copy(dst), copy)
    full = al.alloc_extend([0], [40], [-1], 40)
    with pytest.raises(ValueError, match=r"swa mask .* at rows \[0, 1, 2, 3, 4, 5, 6, 7\] and "
                                         r"24 more"):
        pool.load_cpu_copy(copy, full)


@pytest.mark.parametrize("case", ["c4 offset", "swa evicted"])
def test_disagreeing_masks_raise_naming_rows_before_writing(case):
    pool, al = small_pool((0, 4), full_tokens=16 * 16, swa_tokens=16 * 16, page_size=16)
    src = al.alloc_extend([0], [20], [-1], 20)
    fill_random(pool, seed=3)
    copy = pool.get_cpu_copy(src)
    block = al.alloc(3 * 16)
    if case == "c4 offset":
        dst, match = block[1:21], r"c4 mask of the new indices disagrees with the copy at rows \[2,"
    else:
        al.free_swa(block[:16])
        dst, match = block[:20], r"swa mask .* at rows \[0, 1, 2"
    before = snapshot(pool)
    with pytest.raises(ValueError, match=match):
        pool.load_cpu_copy(copy, dst)
    after = snapshot(pool)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_loads_raise_naming_the_argument():
    pool, al = small_pool((0, 4), full_tokens=16 * 16, swa_tokens=16 * 16, page_size=16)
    src = al.alloc(16)
    with_state, without_state = pool.get_cpu_copy(src, 1), pool.get_cpu_copy(src)
    dst = al.alloc(16)
    with pytest.raises(ValueError, match="pass req_pool_idx exactly when the copy holds"):
        pool.load_cpu_copy(with_state, dst)
    with pytest.raises(ValueError, match="pass req_pool_idx exactly when the copy holds"):
        pool.load_cpu_copy(without_state, dst, 1)
    with pytest.raises(ValueError, match="indices has 15 locations but the copy holds 16"):
        pool.load_cpu_copy(without_state, dst[:15])
    with pytest.raises(IndexError, match="req_pool_idx=9; valid request slots are 0..3"):
        pool.get_cpu_copy(src, 9)
    with pytest.raises(IndexError, match="indices holds 272"):
        pool.get_cpu_copy(torch.tensor([272]))
    other, _ = small_pool((0, 0), full_tokens=16 * 16, swa_tokens=16 * 16, page_size=16)
    with pytest.raises(ValueError, match="the copy holds caches"):
        other.load_cpu_copy(without_state, dst)
    swapped, swapped_al = small_pool((4, 0), full_tokens=16 * 16, swa_tokens=16 * 16,
                                     page_size=16)
    with pytest.raises(ValueError, match=r"the copy's c4 layers \[1\] are not this pool's \[0\]"):
        swapped.load_cpu_copy(without_state, swapped_al.alloc(16))


def test_a_copy_missing_a_state_layer_raises_naming_the_state_before_writing():
    pool, al = small_pool((0, 4), full_tokens=16 * 16, swa_tokens=16 * 16, page_size=16)
    fill_random(pool, seed=4)
    copy = pool.get_cpu_copy(al.alloc(16), 1)
    del copy.states["indexer_compressor_state"][1]
    before = snapshot(pool)
    with pytest.raises(ValueError, match=r"the copy's indexer_compressor_state layers \[\] are "
                                         r"not this pool's \[1\]"):
        pool.load_cpu_copy(copy, al.alloc(16), 2)
    after = snapshot(pool)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_round_trip_while_the_default_device_is_not_the_pools():
    # on a GPU the pool's tensors are off the default (CPU) device; here the pool is on the CPU
    # and the default device is meta: the copy's index tensors must follow the pool's tensors
    pool, al = small_pool((0, 4), full_tokens=16 * 16, swa_tokens=16 * 16, page_size=16)
    src = al.alloc_extend([0], [37], [-1], 37)
    dst = al.alloc(4 * 16)[4:4 + 37]
    fill_random(pool, seed=5)
    with torch.device("meta"):
        copy = pool.get_cpu_copy(src, req_pool_idx=1)
        pool.load_cpu_copy(copy, dst, req_pool_idx=2)
    assert copy.families["indexer"].layers[1][0].device == torch.device("cpu")
    assert_same_copy(pool.get_cpu_copy(dst, req_pool_idx=2), copy)


def test_loading_a_copy_with_state_says_it_needs_a_request_slot():
    P = 4
    pool, al = small_pool((4,), full_tokens=8 * P, swa_tokens=8 * P, page_size=P)
    locs = al.alloc(P)
    copy = pool.get_cpu_copy(locs)                                # no request slot: no state
    with pytest.raises(ValueError, match=r"compressor state \(it does not\)"):
        pool.load_cpu_copy(copy, locs, req_pool_idx=1)


def test_int32_locations_whose_indexer_bytes_pass_2_31_round_trip(monkeypatch):
    """int32 locations (SGLang's req_to_token rows) of a pool of 2^26 tokens: their indexer rows
    start past 2^31 bytes; the copy holds the keys stored there and a load puts them at the new
    rows. The caches are anonymous maps (only the pages touched cost memory); no location has an
    SWA slot."""
    import mmap

    from mem_pool.dsv4_pool import DeepSeekV4TokenToKVPool
    from mem_pool.kv_cache_spec import KVCacheSpec

    def mapped_bytes(self, pages, row_bytes):
        try:
            buf = mmap.mmap(-1, pages * row_bytes)
        except (OSError, ValueError, OverflowError) as e:
            pytest.skip(f"cannot map {pages * row_bytes} bytes of virtual memory: {e}")
        return torch.frombuffer(buf, dtype=torch.uint8).view(pages, row_bytes)

    monkeypatch.setattr(DeepSeekV4TokenToKVPool, "_bytes", mapped_bytes)
    tokens, page_size = 2 ** 26, 64
    pool = DeepSeekV4TokenToKVPool(KVCacheSpec((4,)), tokens, page_size, page_size, "cpu", 1,
                                   cache_swa_translation=False, swa_cache_verify=False)
    pool.register_mapping(torch.tensor([-1]).expand(tokens + page_size + 1))
    src = torch.tensor([tokens - 4 * 64 + 3], dtype=torch.int32)
    dst = torch.tensor([tokens - 4 * 130 + 3], dtype=torch.int32)
    src_row, dst_row = src.long() // 4, dst.long() // 4
    assert int(dst_row) * kv_layout.INDEX_TOKEN_BYTES > 2 ** 31
    cache, c4_page = pool.get_indexer_cache(0), pool.c4_page_size
    key = torch.linspace(-3, 3, kv_layout.INDEX_DIM).to(torch.bfloat16)[None]
    dialect = hip_kernels.DEFAULT_KERNEL_OPTIONS.fp8_dialect       # the store's
    hip_kernels.indexer_store(key, cache, src_row, c4_page)
    stored = kv_layout.read_indexer_rows(cache, src_row, c4_page, dialect)
    assert bool((stored != 0).any())
    copy = pool.get_cpu_copy(src)
    q, scale = copy.families["indexer"].layers[0]
    dequant = q.view(dialect.torch_dtype).float() * scale.view(torch.float32)
    assert torch.equal(dequant, stored)
    pool.load_cpu_copy(copy, dst)
    assert torch.equal(kv_layout.read_indexer_rows(cache, dst_row, c4_page, dialect), stored)
