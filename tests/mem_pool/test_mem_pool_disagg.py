"""Disaggregated-decode tail preallocation: the tail formula by hand, the two budgets charged in
whole pages, and that the allocator takes exactly that charge."""

import pytest
import torch
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


# The tail at page and window boundaries, from the window and page arithmetic.

TAIL_PAGE = 16


def boundary_cases():
    """(seq_len, window): one below, at and one above the window, the window plus a page, and
    a page boundary far past the window, for a window that is a whole number of pages and one
    that is not."""
    for window in (32, 40):
        for edge in (window, window + TAIL_PAGE, 6 * TAIL_PAGE):
            for seq_len in (edge - 1, edge, edge + 1):
                yield seq_len, window


def window_pages(seq_len: int, window: int) -> set[int]:
    """The pages holding the window of the last prompt token: positions seq_len - window ..
    seq_len - 1 (all of them when the prompt is shorter than the window)."""
    return {q // TAIL_PAGE for q in range(max(0, seq_len - window), seq_len)}


@pytest.mark.parametrize("seq_len, window", list(boundary_cases()))
def test_the_disaggregated_swa_tail_covers_the_last_window_in_whole_pages(seq_len, window):
    """The decode side gets SWA slots for exactly the positions that lie on a page holding part of
    the last prompt token's window (so every position the first decoded token attends, seq_len -
    window + 1 .. seq_len - 1, has one); every other position has none, and SWA slots keep their
    full location's in-page offset. The tail length and the pages charged follow."""
    pages = window_pages(seq_len, window)
    with_swa = [q for q in range(seq_len) if q // TAIL_PAGE in pages]
    assert with_swa == list(range(seq_len - len(with_swa), seq_len))      # a tail, by design
    assert set(range(max(0, seq_len - window + 1), seq_len)) <= set(with_swa)
    assert swa_tail_len(seq_len, window, TAIL_PAGE) == len(with_swa)

    _, al = small_pool((0,), full_tokens=8 * TAIL_PAGE, swa_tokens=8 * TAIL_PAGE,
                       page_size=TAIL_PAGE)
    budget = PreallocBudget.from_allocator(al)
    lens = budget.try_reserve(seq_len, window)
    assert (lens.full_len, lens.swa_len) == (seq_len, len(with_swa))
    locs = al.alloc_extend_swa_tail(seq_len, lens.swa_len)
    assert locs.numel() == seq_len
    swa = al.full_to_swa_index_mapping[locs]
    assert [q for q in range(seq_len) if swa[q] > 0] == with_swa
    assert torch.equal(swa[swa > 0] % TAIL_PAGE, locs[swa > 0] % TAIL_PAGE)
    assert al.swa_available_size() == al.size_swa - len(pages) * TAIL_PAGE
    assert al.full_available_size() == al.size_full - -(-seq_len // TAIL_PAGE) * TAIL_PAGE
    assert (budget.full_tokens, budget.swa_tokens) == (al.full_available_size(),
                                                       al.swa_available_size())
