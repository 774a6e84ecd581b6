"""The one "an SWA page left the window" rule, by hand, and the places that use it agreeing."""

import pytest
from mem_pool_testlib import small_pool

from mem_pool import pages_out_of_window, swa_tail_len, swa_window_pages

# seq_len, window, page_size, pages out:  max(0, seq_len - window) // page_size
TABLE = [
    (0, 128, 64, 0),
    (128, 128, 64, 0),          # every position still in the window
    (191, 128, 64, 0),          # positions 0..62 out: page 0 not yet whole
    (192, 128, 64, 1),          # positions 0..63 out: page 0
    (1000, 128, 256, 3),        # 872 out -> pages 0..2
    (14, 5, 4, 2),              # 9 out -> pages 0..1
]


@pytest.mark.parametrize("seq_len, window, page_size, pages", TABLE)
def test_pages_out_of_window_by_hand(seq_len, window, page_size, pages):
    assert pages_out_of_window(seq_len, window, page_size) == pages


@pytest.mark.parametrize("seq_len, window, page_size, pages", TABLE)
def test_the_disaggregated_tail_and_the_commit_window_start_where_the_rule_ends(
        seq_len, window, page_size, pages):
    assert swa_tail_len(seq_len, window, page_size) == seq_len - pages * page_size
    if seq_len:
        assert swa_window_pages(seq_len, page_size, window)[0] == pages


def test_the_allocator_frees_exactly_the_pages_out_of_the_window():
    pool, al = small_pool(full_tokens=8 * 4, swa_tokens=8 * 4, page_size=4)
    locs = al.alloc_extend([0], [14], [-1], 14)
    assert al.free_swa_out_of_window(locs, 14, 5) == pages_out_of_window(14, 5, 4) == 2


def test_never_shrinks_as_the_request_grows():
    counts = [pages_out_of_window(n, 7, 4) for n in range(60)]
    assert counts == sorted(counts) and counts[-1] == (59 - 7) // 4


@pytest.mark.parametrize("args, name", [((-1, 32, 16), "seq_len"), ((50, 0, 16), "window"),
                                        ((50, 32, 0), "page_size")])
def test_bad_lengths_raise_naming_the_argument(args, name):
    with pytest.raises(ValueError, match=f"{name} must be >= "):
        pages_out_of_window(*args)
