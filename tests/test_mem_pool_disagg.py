"""Disaggregated-decode tail preallocation: the SPEC formula by hand, the two budgets charged in
whole pages, and that the allocator takes exactly that charge."""

import pytest
from mem_pool_testlib import small_pool

from mem_pool import PreallocBudget, PreallocLens, prealloc_kv_lens, swa_tail_len

# tail = seq_len - floor_to_page(max(0, seq_len - window)), by hand:
TAIL_TABLE = [
    # seq_len, window, page, tail     seq_len - window -> floor to page -> tail
    (50, 32, 16, 34),               # 18 -> 16 -> 50 - 16
    (1000, 128, 256, 232),          # 872 -> 768 -> 1000 - 768
    (64, 32, 16, 32),               # 32 -> 32 -> 64 - 32
    (16, 32, 16, 16),               # -16 -> 0 -> 16 - 0
]


@pytest.mark.parametrize("seq_len, window, page_size, tail", TAIL_TABLE)
def test_tail_preallocation_table(seq_len, window, page_size, tail):
    assert swa_tail_len(seq_len, window, page_size) == tail
    assert prealloc_kv_lens(seq_len, window, page_size) == PreallocLens(seq_len, tail)


def test_charges_are_whole_pages_on_both_sides():
    assert PreallocLens(50, 34).charge(16) == (64, 48)
    assert PreallocLens(1000, 232).charge(256) == (1024, 256)


@pytest.mark.parametrize("seq_len, window, page_size, tail",
                         [row for row in TAIL_TABLE if row[2] == 16])
def test_the_allocator_takes_exactly_the_charge(seq_len, window, page_size, tail):
    pool, al = small_pool((0,), full_tokens=8 * page_size, swa_tokens=8 * page_size,
                          page_size=page_size)
    before = PreallocBudget.from_allocator(al)
    lens = before.try_reserve(seq_len, window)
    locs = al.alloc_extend_swa_tail(seq_len, lens.swa_len)
    assert locs.numel() == seq_len
    assert (al.full_available_size(), al.swa_available_size()) == (before.full_tokens,
                                                                   before.swa_tokens)
    assert int((al.full_to_swa_index_mapping[locs] > 0).sum()) == tail


def test_budget_checks_both_sides_before_charging_either():
    budget = PreallocBudget(full_tokens=1024, swa_tokens=32, page_size=16)
    assert budget.try_reserve(50, 32) is None            # SWA needs 48
    assert (budget.full_tokens, budget.swa_tokens) == (1024, 32)
    assert budget.try_reserve(64, 32) == PreallocLens(64, 32)
    assert (budget.full_tokens, budget.swa_tokens) == (960, 0)
    assert PreallocBudget(16, 1024, 16).try_reserve(50, 32) is None   # full needs 64


@pytest.mark.parametrize("args, name", [((-1, 32, 16), "seq_len"), ((50, 0, 16), "window"),
                                        ((50, 32, 0), "page_size")])
def test_bad_lengths_raise_naming_the_argument(args, name):
    with pytest.raises(ValueError, match=f"{name} must be >= "):
        swa_tail_len(*args)
