"""PagedAllocator and the two-sided SWA allocator: locations, page pairing, exhaustion without
leaks, page-aligned freeing, load-back remapping, backup/restore."""

import pytest
import torch
from mem_pool_testlib import small_pool

from mem_pool import KVCacheSpec, PagedAllocator, create_dsv4_kv_cache
from mem_pool.loc_checks import check_loc_tensor

P = 4


def pages_of(locs):
    return sorted(set((locs // P).tolist()))


# ---- PagedAllocator -----------------------------------------------------------------------


def test_alloc_hands_out_whole_pages_never_page_zero():
    a = PagedAllocator(8 * P, P)
    locs = a.alloc(3 * P)
    assert locs.dtype == torch.int64
    assert locs.tolist() == list(range(P, 4 * P))
    assert a.available_size() == 5 * P
    with pytest.raises(ValueError, match="need_size=3 must be a multiple of page_size=4"):
        a.alloc(3)


@pytest.mark.parametrize("size,page_size", [(6, 4), (2, 4), (0, 4), (4, 0)])
def test_a_size_that_is_not_whole_pages_is_refused(size, page_size):
    """(a partial last page would hand out locations past the end of the caches)"""
    with pytest.raises(ValueError, match=f"size={size} must be a positive multiple of "
                                         f"page_size={page_size}|page_size must be >= 1"):
        PagedAllocator(size, page_size)


@pytest.mark.parametrize("loc", [0, P - 1, 9 * P, 9 * P + 1])
def test_freeing_a_location_outside_the_handed_out_pages_is_refused(loc):
    """Page 0 (the dummy) and anything past the last page are nobody's; freeing them must not
    reach the free list."""
    a = PagedAllocator(8 * P, P)
    a.alloc(8 * P)
    with pytest.raises(IndexError,
                       match=rf"free_index holds {loc}; valid values are {P}..{9 * P - 1}"):
        a.free(torch.tensor([loc]))
    assert a.available_size() == 0


def test_exhaustion_returns_none_and_takes_nothing():
    a = PagedAllocator(2 * P, P)
    assert a.alloc(3 * P) is None
    assert a.available_size() == 2 * P
    assert a.alloc_extend([0], [9], [-1], 9) is None
    assert a.available_size() == 2 * P


def test_alloc_extend_fills_the_prefix_page_then_takes_new_pages():
    a = PagedAllocator(8 * P, P)
    first = a.alloc_extend([0, 0], [6, 3], [-1, -1], 9)
    assert first.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]
    more = a.alloc_extend([6], [11], [int(first[5])], 5)
    assert more.tolist() == [10, 11, 16, 17, 18]   # positions 6, 7 continue page 2; 8.. page 4


def test_alloc_extend_rejects_inconsistent_arguments():
    a = PagedAllocator(8 * P, P)
    with pytest.raises(ValueError, match="extend_num_tokens=5"):
        a.alloc_extend([0], [6], [-1], 5)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=2 must be >= prefix_lens\[0\]=3"):
        a.alloc_extend([3], [2], [10], -1)
    with pytest.raises(ValueError, match=r"last_loc\[0\]=8 must sit at in-page offset"):
        a.alloc_extend([2], [4], [8], 2)
    with pytest.raises(ValueError, match="last_loc refers to page 2, which is not allocated"):
        a.alloc_extend([2], [4], [9], 2)   # page 2 was never handed out
    with pytest.raises(TypeError, match="seq_lens must have dtype"):
        a.alloc_extend([0], torch.tensor([1.0]), [-1], 1)
    assert a.available_size() == 8 * P


def test_alloc_decode_starts_a_page_only_on_a_page_boundary():
    a = PagedAllocator(8 * P, P)
    locs = a.alloc_extend([0, 0], [4, 2], [-1, -1], 6)     # pages 1 and 2
    out = a.alloc_decode([5, 3], [int(locs[3]), int(locs[5])])
    assert out.tolist() == [12, 10]                         # new page 3; page 2 continues


def test_alloc_decode_on_the_host_hands_out_the_same_locations_as_ints():
    """to_device=False: the same locations and bookkeeping, as host ints (no device copy)."""
    got = []
    for to_device in (True, False):
        a = PagedAllocator(8 * P, P)
        locs = a.alloc_extend([0, 0], [4, 2], [-1, -1], 6)
        out = a.alloc_decode([5, 3], [int(locs[3]), int(locs[5])], to_device=to_device)
        got.append((out.tolist() if to_device else out, a.last_handed_out.tolist(),
                    a._page_fill.tolist(), a.available_size()))
    assert got[0] == got[1] and got[1][0] == [12, 10]


def test_double_free_raises_and_changes_nothing():
    a = PagedAllocator(8 * P, P)
    locs = a.alloc(2 * P)
    a.free(locs[:1])                                         # frees page 1 (partial is fine)
    before = a.available_size()
    with pytest.raises(ValueError, match="page 1, which is not allocated"):
        a.free(locs)
    assert a.available_size() == before
    with pytest.raises(IndexError, match="free_index holds 0"):
        a.free(torch.tensor([0]))                            # the dummy page


def test_paged_backup_restore():
    a = PagedAllocator(8 * P, P)
    a.alloc(P)
    state = a.backup_state()
    a.alloc(3 * P)
    a.restore_state(state)
    assert a.available_size() == 7 * P
    assert a.alloc(P).tolist() == [8, 9, 10, 11]


# ---- SWATokenToKVPoolAllocator --------------------------------------------------------------


def test_swa_alloc_pairs_pages_keeping_offsets_and_the_trailing_sentinel():
    pool, al = small_pool(full_tokens=16 * P, swa_tokens=8 * P, page_size=P)
    mapping = al.full_to_swa_index_mapping
    assert mapping.shape == (16 * P + P + 1,) and int(mapping[-1]) == -1
    locs = al.alloc_extend([0], [7], [-1], 7)
    swa = mapping[locs]
    assert (swa > 0).all() and (swa % P == locs % P).all()
    assert len(pages_of(swa)) == len(pages_of(locs)) == 2
    assert mapping[:P].tolist() == [0] * P                   # page 0: no SWA slot


def test_mapping_storage_survives_every_mutation():
    pool, al = small_pool(full_tokens=16 * P, swa_tokens=8 * P, page_size=P)
    mapping = al.full_to_swa_index_mapping
    ptr = mapping.data_ptr()
    locs = al.alloc(2 * P)
    al.alloc_decode([9], [int(locs[-1])])
    state = al.backup_state()
    al.free_swa(locs[:P])
    al.restore_state(state)
    al.free(locs)
    al.clear()
    assert al.full_to_swa_index_mapping is mapping and mapping.data_ptr() == ptr
    assert pool.full_to_swa_index_mapping is mapping
    assert int(mapping[-1]) == -1


@pytest.mark.parametrize("short_side", ["full", "swa"])
def test_failed_two_sided_alloc_leaks_nothing(short_side):
    sizes = {"full": 2 * P, "swa": 8 * P} if short_side == "full" else {"full": 8 * P,
                                                                       "swa": 2 * P}
    pool, al = small_pool(full_tokens=sizes["full"], swa_tokens=sizes["swa"], page_size=P)
    gen = pool.mapping_generation
    before = (al.full_available_size(), al.swa_available_size())
    assert al.alloc(3 * P) is None
    assert al.alloc_extend([0], [3 * P], [-1], 3 * P) is None
    assert al.alloc_extend_swa_tail(3 * P, 3 * P) is None
    locs = al.alloc(2 * P)
    assert al.alloc_decode([2 * P + 1], [int(locs[-1])]) is None
    al.free(locs)
    assert (al.full_available_size(), al.swa_available_size()) == before
    assert (al.full_to_swa_index_mapping[:-1] == 0).all()
    assert pool.mapping_generation == gen + 2                # the alloc and the free only


def test_free_releases_both_sides_of_every_touched_page():
    pool, al = small_pool(full_tokens=8 * P, swa_tokens=8 * P, page_size=P)
    locs = al.alloc_extend([0], [6], [-1], 6)
    al.free(locs)
    assert al.full_available_size() == al.swa_available_size() == 8 * P
    assert (al.full_to_swa_index_mapping[:-1] == 0).all()


def test_free_swa_needs_whole_pages_and_keeps_the_full_side():
    pool, al = small_pool(full_tokens=8 * P, swa_tokens=8 * P, page_size=P)
    locs = al.alloc(2 * P)
    with pytest.raises(ValueError, match="free_index must cover whole pages of page_size=4"):
        al.free_swa(locs[:3])
    assert al.swa_available_size() == 6 * P
    al.free_swa(locs[:P])
    al.free_swa(locs[:P])                                     # already without SWA: skipped
    assert al.swa_available_size() == 7 * P and al.full_available_size() == 6 * P
    assert al.full_to_swa_index_mapping[locs[:P]].tolist() == [0] * P
    assert (al.full_to_swa_index_mapping[locs[P:]] > 0).all()


def test_free_swa_out_of_window_evicts_whole_pages_behind_the_window():
    pool, al = small_pool(full_tokens=8 * P, swa_tokens=8 * P, page_size=P)
    locs = al.alloc_extend([0], [14], [-1], 14)               # pages for positions 0..13
    # window 5: positions < 14 - 5 = 9 are out; whole pages before floor_to_page(9) = 8.
    assert al.free_swa_out_of_window(locs, 14, 5) == 2
    assert al.free_swa_out_of_window(locs, 14, 5) == 0
    mapped = al.full_to_swa_index_mapping[locs] > 0
    assert mapped.tolist() == [False] * 8 + [True] * 6
    with pytest.raises(ValueError, match="req_full_loc must be page-aligned by position"):
        al.free_swa_out_of_window(locs[1:], 14, 1)
    # window 1: positions < 13 are out, whole pages up to position 11; 5 locations are too few
    with pytest.raises(ValueError, match=r"has 5 locations but positions 0\.\.11 leave the "
                                         r"window \(seq_len=14, window=1\)"):
        al.free_swa_out_of_window(locs[:5], 14, 1)
    with pytest.raises(TypeError, match="^req_full_loc must have dtype torch.int32 or"):
        al.free_swa_out_of_window(locs.float(), 14, 5)
    # an allocation cannot continue a page whose SWA page is gone
    al.free_swa(al.full_attn_allocator.page_locations(locs[13:] // P))
    with pytest.raises(ValueError, match="on a page whose SWA page was freed"):
        al.alloc_decode([15], [int(locs[13])])


def test_set_full_to_swa_mapping_load_back_and_its_checks():
    pool, al = small_pool(full_tokens=8 * P, swa_tokens=4 * P, page_size=P)
    locs = al.alloc(2 * P)
    al.free_swa(locs[:P])
    swa = al.swa_attn_allocator.alloc(P)
    with pytest.raises(ValueError, match="in-page offset"):
        al.set_full_to_swa_mapping(locs[:P], swa.roll(1))
    with pytest.raises(ValueError, match="already mapped elsewhere"):
        al.set_full_to_swa_mapping(locs[P:], swa)
    unallocated = min({1, 2, 3, 4} - set(pages_of(al.full_to_swa_index_mapping[locs]))
                      - set(pages_of(swa)))
    with pytest.raises(ValueError, match=f"refers to page {unallocated}, which is not allocated"):
        al.set_full_to_swa_mapping(locs[:P], torch.arange(unallocated * P, unallocated * P + P))
    al.set_full_to_swa_mapping(locs[:P], swa)
    assert al.full_to_swa_index_mapping[locs[:P]].tolist() == swa.tolist()
    al.free(locs)
    assert al.swa_available_size() == 4 * P                   # the loaded-back page too


def test_restore_state_restores_the_mapping():
    pool, al = small_pool(full_tokens=8 * P, swa_tokens=8 * P, page_size=P)
    locs = al.alloc(P)
    saved_mapping = al.full_to_swa_index_mapping.clone()
    state = al.backup_state()
    al.alloc_decode([P + 1], [int(locs[-1])])
    al.free_swa(locs)
    al.restore_state(state)
    assert torch.equal(al.full_to_swa_index_mapping, saved_mapping)
    assert al.full_available_size() == 7 * P and al.swa_available_size() == 7 * P


def test_alloc_extend_swa_tail_maps_only_the_page_aligned_tail():
    pool, al = small_pool(full_tokens=16 * P, swa_tokens=4 * P, page_size=P)
    locs = al.alloc_extend_swa_tail(13, 5)                    # 13 - 5 = 8: page aligned
    assert locs.numel() == 13
    mapped = (al.full_to_swa_index_mapping[locs] > 0).tolist()
    assert mapped == [False] * 8 + [True] * 5
    assert al.swa_available_size() == 2 * P
    with pytest.raises(ValueError, match="swa_tail_len=6 must be in 0..seq_len=13"):
        al.alloc_extend_swa_tail(13, 6)


def test_allocations_under_inference_mode_are_versioned_tensors():
    pool, al = small_pool()
    with torch.inference_mode():
        locs = al.alloc(P)
        out = al.alloc_decode([P + 1], [int(locs[-1])])
    assert not locs.is_inference() and not out.is_inference()


def test_allocator_page_size_must_match_the_pool():
    from mem_pool import SWATokenToKVPoolAllocator
    pool, _ = small_pool(full_tokens=16 * P, page_size=P)
    with pytest.raises(ValueError, match="page_size=4"):
        SWATokenToKVPoolAllocator(16 * P, 8 * P, 2 * P, pool, "cpu")


@pytest.mark.parametrize("need", [-128, -4, 0, 2.0 * 4, True])
def test_non_positive_or_non_int_sizes_are_refused_and_nothing_is_taken(need):
    paged = PagedAllocator(32, 4)
    _, swa = small_pool(full_tokens=32, swa_tokens=32, page_size=4)
    for allocator, free in ((paged, paged.available_size),
                            (swa, lambda: (swa.full_available_size(), swa.swa_available_size()))):
        before = free()
        with pytest.raises(ValueError, match="need_size must be a positive int"):
            allocator.alloc(need)
        assert free() == before


def swa_and_paged():
    """A plain paged allocator and a two-sided one, each with its free-count reading."""
    paged = PagedAllocator(8 * P, P)
    _, swa = small_pool(full_tokens=8 * P, swa_tokens=8 * P, page_size=P)
    return [(paged, paged.available_size),
            (swa, lambda: (swa.full_available_size(), swa.swa_available_size(),
                           swa.full_to_swa_index_mapping.clone()))]


def same_state(before, after):
    return all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(before if isinstance(before, tuple) else (before,),
                               after if isinstance(after, tuple) else (after,)))


@pytest.mark.parametrize("second", ["decode", "extend"])
def test_two_allocations_from_one_last_loc_are_refused(second):
    """A request forked by mistake (or a stale last_loc) would take a slot someone already
    holds; the second allocation is refused and nothing changes."""
    for a, state in swa_and_paged():
        locs = a.alloc_extend([0], [2], [-1], 2)              # offsets 0, 1 of one page
        first = a.alloc_decode([3], [int(locs[-1])])          # offset 2
        assert int(first) == int(locs[-1]) + 1
        before = state()
        stale = int(locs[-1])
        with pytest.raises(ValueError, match=(
                rf"last_loc\[0\]={stale} is not the last location handed out on page "
                rf"{stale // P} \(offsets 0\.\.2 are taken\): its next location already "
                "belongs to an earlier allocation")):
            if second == "decode":
                a.alloc_decode([3], [int(locs[-1])])
            else:
                a.alloc_extend([2], [4], [int(locs[-1])], 2)
        assert same_state(before, state())
        assert a.alloc_decode([4], [int(first)]).tolist() == [int(first) + 1]   # the real tail


def test_one_page_continued_by_two_rows_is_refused():
    for a, state in swa_and_paged():
        locs = a.alloc_extend([0], [1], [-1], 1)
        before = state()
        with pytest.raises(ValueError, match="continues one page from two rows"):
            a.alloc_decode([2, 2], [int(locs[0])] * 2)
        assert same_state(before, state())


def test_a_freed_and_reallocated_page_is_continued_from_its_new_tail_only():
    for a, _ in swa_and_paged():
        old = a.alloc_extend([0], [3], [-1], 3)
        a.free(old)
        new = a.alloc_extend([0], [1], [-1], 1)               # may reuse the same page
        with pytest.raises(ValueError, match="is not the last location|not allocated"):
            a.alloc_decode([4], [int(old[-1])])
        assert a.alloc_decode([2], [int(new[0])]).tolist() == [int(new[0]) + 1]


def test_allocator_messages_name_free_index():
    a = PagedAllocator(8 * P, P)
    with pytest.raises(TypeError, match="^free_index must have dtype"):
        a.free(torch.tensor([4.0]))
    locs = a.alloc(P)
    a.free(locs)
    with pytest.raises(ValueError, match="^free_index refers to page 1, which is not allocated"):
        a.free(locs)


def test_check_loc_tensor_names_the_type_it_got():
    with pytest.raises(TypeError, match="loc must be a torch.Tensor, got list"):
        check_loc_tensor("loc", [1, 2], torch.device("cpu"))


def test_the_pool_defaults_to_the_cpu():
    pool, allocator = create_dsv4_kv_cache(KVCacheSpec((0,)), 4 * P, 4 * P, P)
    assert pool.device == torch.device("cpu")
    assert allocator.alloc(P).device == torch.device("cpu")


def test_the_smallest_valid_sizes_are_accepted():
    _, al = small_pool(full_tokens=4 * P, swa_tokens=4 * P, page_size=P)
    assert al.alloc_extend_swa_tail(1, 1).tolist() == [P]        # one token, its SWA slot
    assert KVCacheSpec((0,), window_size=1).window_size == 1
