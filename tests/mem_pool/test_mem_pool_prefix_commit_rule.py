"""The SWA all-or-nothing rule. Expected values come from the window's definition: the
positions [max(0, k - window), k) listed one by one and mapped to their pages."""

import itertools
import random

import pytest

from mem_pool import (CommitPlan, PageRelease, commit_plan, plan_prefix_commit,
                      release_short_prefetch, swa_window_pages)

T, F = True, False


def window_pages_from_positions(k, page_size, window):
    return sorted({p // page_size for p in range(max(0, k - window), k)})


def best_commit_by_definition(full, swa, page_size, window):
    """The largest k = j * page_size with full pages 0..j-1 and the window's SWA pages all
    available, trying every j."""
    best = 0
    for j in range(1, len(full) + 1):
        k = j * page_size
        if all(full[:j]) and all(swa[q] for q in window_pages_from_positions(k, page_size,
                                                                             window)):
            best = k
    return best


# page_size 4. (case, window, full, swa, commit tokens, SWA pages) worked out by hand:
TABLE = [
    # window before 24 = positions 14..23 -> pages 3 (14, 15), 4, 5: starts inside page 3
    ("longer than window + page", 10, [T] * 6, [T] * 6, 24, [3, 4, 5]),
    # positions 16..23 -> pages 4, 5: the window starts exactly on a page boundary
    ("window ends on a page boundary", 8, [T] * 6, [T] * 6, 24, [4, 5]),
    # 8 tokens, window 10: positions 0..7 -> pages 0, 1
    ("shorter than one window", 10, [T] * 2, [T] * 2, 8, [0, 1]),
    # 12 tokens, window 12: positions 0..11
    ("exactly one window", 12, [T] * 3, [T] * 3, 12, [0, 1, 2]),
    # SWA of pages 0..2 is outside the window before 24: not needed
    ("SWA outside the window missing", 10, [T] * 6, [F, F, F, T, T, T], 24, [3, 4, 5]),
    # before 24 needs 4, 5 (5 missing); before 20 = 12..19 -> pages 3, 4: both there
    ("an earlier window is complete", 8, [T] * 6, [F, F, F, T, T, F], 20, [3, 4]),
    # every window of 10 tokens before k = 4..24 overlaps page 4 or an absent page
    ("no window is complete", 10, [T] * 6, [F, F, F, T, F, T], 0, []),
    # full page 3 missing caps j at 3; before 12 = 2..11 -> pages 0, 1, 2
    ("a full page missing", 10, [T, T, T, F, T, T], [T] * 6, 12, [0, 1, 2]),
    ("first full page missing", 10, [F, T, T], [T] * 3, 0, []),
    # window 3 < page: before 16 = 13..15 -> page 3 alone
    ("window shorter than a page", 3, [T] * 4, [F, F, F, T], 16, [3]),
    ("window of one token", 1, [T] * 4, [F, F, F, T], 16, [3]),
    ("empty prefix", 10, [], [], 0, []),
]


@pytest.mark.parametrize("case, window, full, swa, tokens, swa_pages", TABLE,
                         ids=[row[0] for row in TABLE])
def test_commit_table(case, window, full, swa, tokens, swa_pages):
    assert window_pages_from_positions(tokens, 4, window) == swa_pages   # the table's own check
    plan = plan_prefix_commit(full, swa, 4, window)
    assert plan.commit_tokens == tokens
    assert list(plan.full_pages) == list(range(tokens // 4))
    assert list(plan.swa_pages) == swa_pages


@pytest.mark.parametrize("page_size, window", [(4, 10), (4, 8), (4, 3), (2, 7), (3, 12)])
def test_every_availability_pattern_matches_the_definition(page_size, window):
    for m in range(6):
        for bits in itertools.product((F, T), repeat=2 * m):
            full, swa = list(bits[:m]), list(bits[m:])
            plan = plan_prefix_commit(full, swa, page_size, window)
            k = best_commit_by_definition(full, swa, page_size, window)
            assert plan.commit_tokens == k, (full, swa)
            assert list(plan.swa_pages) == window_pages_from_positions(k, page_size, window)


RELEASE_TABLE = [
    # plan 24 (window 10: SWA 3, 4, 5); SWA 4 lost: every shorter window needs 2 or 4
    ("SWA page lost, long prefix", 6, 10, range(6), [3, 5], 0, range(6), [3, 5]),
    # plan 8 (SWA 0, 1); full page 1 lost: commit 4 = SWA page 0; SWA page 1 goes back
    ("full page lost, short prefix", 2, 10, [0], [0, 1], 4, [], [1]),
    ("everything arrived", 3, 10, range(3), range(3), 12, [], []),
    # plan 24 (window 8: SWA 4, 5); SWA 5 lost; before 20 = 12..19 needs page 3: never loaded
    ("the shorter window was never loaded", 6, 8, range(6), [4], 0, range(6), [4]),
    ("nothing arrived", 3, 10, [], [], 0, [], []),
]


@pytest.mark.parametrize("case, m, window, full, swa, tokens, rel_full, rel_swa",
                         RELEASE_TABLE, ids=[row[0] for row in RELEASE_TABLE])
def test_short_prefetch_table(case, m, window, full, swa, tokens, rel_full, rel_swa):
    plan = plan_prefix_commit([T] * m, [T] * m, 4, window)
    assert plan.commit_tokens == 4 * m
    new, release = release_short_prefetch(plan, full, swa)
    assert new.commit_tokens == tokens
    assert list(new.swa_pages) == window_pages_from_positions(tokens, 4, window)
    assert release == PageRelease(tuple(rel_full), tuple(rel_swa))


def test_short_prefetch_keeps_only_arrived_pages_and_releases_the_rest():
    rng = random.Random(0)
    for _ in range(3000):
        page_size, window, m = rng.choice([2, 4]), rng.randint(1, 14), rng.randint(0, 7)
        full = [rng.random() < 0.9 for _ in range(m)]
        swa = [rng.random() < 0.8 for _ in range(m)]
        plan = plan_prefix_commit(full, swa, page_size, window)
        got_full = {p for p in plan.full_pages if rng.random() < 0.85}
        got_swa = {p for p in plan.swa_pages if rng.random() < 0.85}
        new, release = release_short_prefetch(plan, got_full, got_swa)
        assert set(new.full_pages) <= got_full and set(new.swa_pages) <= got_swa
        assert set(release.full_pages) == got_full - set(new.full_pages)
        assert set(release.swa_pages) == got_swa - set(new.swa_pages)
        assert new.commit_tokens <= plan.commit_tokens
        arrived_full = [p in got_full for p in range(plan.num_pages)]
        arrived_swa = [p in got_swa for p in range(plan.num_pages)]
        assert new.commit_tokens == best_commit_by_definition(arrived_full, arrived_swa,
                                                              page_size, window)


def test_bad_inputs_raise():
    plan = plan_prefix_commit([T] * 3, [T] * 3, 4, 10)
    with pytest.raises(ValueError, match=r"^arrived_full holds pages \[3\] the plan did not load"):
        release_short_prefetch(plan, [0, 3], [])
    with pytest.raises(ValueError, match=r"^arrived_swa holds pages \[6\] the plan did not load"):
        release_short_prefetch(commit_plan(24, 4, 8), [], [6])
    with pytest.raises(ValueError, match=r"^page_size must be a positive int, got 0"):
        CommitPlan(0, (), (), 0, 10)
    with pytest.raises(ValueError, match=r"^window must be a positive int, got 0"):
        CommitPlan(0, (), (), 4, 0)


def test_a_short_window_falls_back_to_an_earlier_window_that_arrived():
    """Pages of 4, window 8: committing 24 needs SWA pages 4, 5; page 5's SWA rows are short,
    but pages 3 and 4 arrived whole (a record carries every family), so 20 is committed, and
    the SWA page before that window (2) is released."""
    plan = commit_plan(24, 4, 8)
    new, release = release_short_prefetch(plan, range(6), [2, 3, 4])
    assert new.commit_tokens == 20 and new.swa_pages == (3, 4)
    assert release == PageRelease((5,), (2,))
    with pytest.raises(ValueError, match="pages"):
        plan_prefix_commit([T] * 3, [T] * 2, 4, 10)
    with pytest.raises(ValueError, match="window"):
        plan_prefix_commit([T], [T], 4, 0)
    with pytest.raises(ValueError, match="page_size"):
        plan_prefix_commit([T], [T], 0, 4)
    with pytest.raises(ValueError, match="exactly the SWA pages"):
        CommitPlan(8, (0, 1), (1,), 4, 10)                 # a partial window
    with pytest.raises(ValueError, match="multiple"):
        CommitPlan(6, (0,), (0, 1), 4, 10)
    assert list(swa_window_pages(0, 4, 10)) == []
