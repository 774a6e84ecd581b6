"""Tensor-parallel agreement on a prefix commit: one all_reduce(MIN), every rank commits the
same amount, releases exactly its surplus, leaks no page and never commits a partial SWA
window. Real gloo process groups of 2 and 4 ranks; page_size 4, window 10 throughout, so the
window before k covers positions max(0, k - 10)..k-1."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from prefix_prefetch_sim import PAGE_SIZE, WINDOW
from spawn_ranks import run_ranks

from mem_pool import Agreement, agree_on_commit, commit_agreed, commit_plan
from mem_pool.prefix.tp_agreement import agreement_from_reduced, pack_outcome

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "prefix_tp_worker.py"


def window_pages(k):
    return sorted({p // PAGE_SIZE for p in range(max(0, k - WINDOW), k)})


# ---- one process ----------------------------------------------------------------------------

def reduce_by_hand(plans, hits):
    """What all_reduce(MIN) gives: the elementwise minimum of every rank's tensor."""
    return torch.stack([pack_outcome(p, h) for p, h in zip(plans, hits)]).min(0).values


@pytest.mark.parametrize("tokens, agreed", [
    # windows before 12 and 8: positions 2..11 and 0..7 -> pages 0-2 and 0-1: both start at 0
    ((12, 8), 8),
    # before 24: 14..23 -> pages 3-5; before 20: 10..19 -> pages 2-4. The rank at 24 lacks
    # SWA page 2, so committing 20 would be a partial window: nothing is committed
    ((24, 20), 0),
    # before 24 and 28: pages 3-5 and 4-6: the 28-rank lacks page 3
    ((24, 28), 0),
    ((24, 24, 24), 24),
    ((0, 24), 0),
    # before 16: 6..15 -> pages 1-3; before 12: pages 0-2; the 16-rank lacks page 0
    ((16, 12), 0),
])
def test_agreement_rule(tokens, agreed):
    plans = [commit_plan(k, PAGE_SIZE, WINDOW) for k in tokens]
    hits = [[k // PAGE_SIZE, 7 - i] for i, k in enumerate(tokens)]
    result = agreement_from_reduced(reduce_by_hand(plans, hits), PAGE_SIZE, WINDOW)
    assert result.commit_tokens == agreed
    assert result.completed_tokens == min(tokens)
    assert list(result.hit_pages) == [min(col) for col in zip(*hits)]
    for plan in plans:
        commit, release = commit_agreed(plan, result)
        assert set(window_pages(agreed)) <= set(plan.swa_pages)
        assert list(commit.swa_pages) == window_pages(agreed)
        assert sorted(release.swa_pages) == sorted(set(plan.swa_pages) - set(window_pages(agreed)))
        assert list(release.full_pages) == list(range(agreed // PAGE_SIZE, plan.num_pages))


def test_a_rank_holding_swa_before_its_window_lets_a_smaller_commit_through():
    """The (24, 20) case above with the 24-rank holding SWA pages from 2 (its records carry
    every family): the window before 20 (pages 2-4) is held by both, so 20 is committed; with
    only its own window held (from page 3) nothing is."""
    plans = [commit_plan(24, PAGE_SIZE, WINDOW), commit_plan(20, PAGE_SIZE, WINDOW)]
    for held, agreed in (((2, 2), 20), ((3, 2), 0)):
        packed = torch.stack([pack_outcome(p, [], h) for p, h in zip(plans, held)]).min(0).values
        result = agreement_from_reduced(packed, PAGE_SIZE, WINDOW)
        assert result.commit_tokens == agreed
        if agreed:
            commit, release = commit_agreed(plans[0], result, swa_held_from=held[0])
            assert commit.swa_pages == (2, 3, 4) and release.full_pages == (5,)
    with pytest.raises(ValueError, match="lacks full pages"):
        commit_agreed(plans[0], Agreement(20, 20, 2, ()))
    with pytest.raises(ValueError, match="swa_held_from=4"):
        pack_outcome(plans[0], [], 4)


def test_no_group_or_one_rank_calls_no_collective(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective was called")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    plan = commit_plan(24, PAGE_SIZE, WINDOW)
    assert agree_on_commit(plan, [6, 3]) == Agreement(24, 24, 3, (6, 3))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert agree_on_commit(plan, [6], group=object()).commit_tokens == 24


def test_a_group_without_torch_distributed_raises(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="not initialized"):
        agree_on_commit(commit_plan(8, PAGE_SIZE, WINDOW), [], group=object())


def test_commit_beyond_the_local_plan_raises():
    with pytest.raises(ValueError, match="lacks"):
        commit_agreed(commit_plan(8, PAGE_SIZE, WINDOW), Agreement(12, 12, 0, ()))
    # 20 tokens fit under a 24-token plan by count, but its window (pages 2-4) does not
    with pytest.raises(ValueError, match=r"SWA pages \[2\]"):
        commit_agreed(commit_plan(24, PAGE_SIZE, WINDOW), Agreement(20, 20, 2, ()))


# ---- real process groups --------------------------------------------------------------------

# (name, ranks, prefix pages, per-rank outcome, each rank's local commit, agreed commit)
SCENARIOS = [
    ("equal", 2, 6, {}, [24, 24], 24),
    # 8 tokens < window: rank 1 gets page 0 only; commit 4 (window 0..3 = page 0)
    ("slow-short-prefix", 2, 2, {1: {"arrive": 1}}, [8, 4], 4),
    # rank 0's SWA file of page 2 is corrupt: 12 needs pages 0-2, 8 needs 0-1 (positions 0..7)
    ("corrupt-swa-file", 2, 3, {0: {"corrupt": [["swa", 2]]}}, [8, 12], 8),
    # rank 1's host tier takes 2 of 3 full pages: 8 tokens, pages 0-1 of SWA; rank 0's 12
    # tokens hold SWA pages 0-2, which cover them
    ("host-full-short", 2, 3, {1: {"host_room": 2}}, [12, 8], 8),
    # rank 1 caches 5 of 6 pages: 20 tokens needs SWA pages 2-4 (positions 10..19), rank 0
    # loaded pages 3-5 for 24 (14..23): no common whole window, nothing committed
    ("host-full-long", 2, 6, {1: {"host_room": 5}}, [24, 20], 0),
    ("equal-4", 4, 6, {}, [24] * 4, 24),
    # 12 tokens; rank 1 slow (pages 0-1: 8), rank 2 lost SWA page 1 (only 0..3 left: 4),
    # rank 3's host took 2 pages (8): 4 tokens, SWA page 0, is whole on every rank
    ("mixed-4", 4, 3, {1: {"arrive": 2}, 2: {"corrupt": [["swa", 1]]}, 3: {"host_room": 2}},
     [12, 8, 4, 8], 4),
    # rank 2's file of full page 5 is corrupt: 20 tokens would need SWA page 2 (never
    # loaded), every shorter commit earlier ones: rank 2 has 0, so all commit 0
    ("corrupt-full-file-4", 4, 6, {2: {"host_pages": 3, "corrupt": [["full", 5]]}},
     [24, 24, 0, 24], 0),
]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    """Run every scenario on 4 gloo ranks (2-rank ones on a group of ranks 0 and 1)."""
    out = tmp_path_factory.mktemp("tp")
    spec = out / "scenarios.json"
    spec.write_text(json.dumps([{"name": n, "ranks": r, "pages": p,
                                 "per_rank": {str(k): v for k, v in per.items()}}
                                for n, r, p, per, _, _ in SCENARIOS]))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(WORKER.parent)]))
    ranks = run_ranks(lambda rank: [str(WORKER), str(rank), "4", str(out / "init"), str(spec),
                                    str(out)], 4, 90, env)
    for rank, (code, log) in enumerate(ranks):
        assert code == 0, f"rank {rank} failed:\n{log[-3000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, pages, per_rank, local, agreed", SCENARIOS,
                         ids=[s[0] for s in SCENARIOS])
def test_ranks_agree_and_release_their_surplus(rank_results, name, ranks, pages, per_rank,
                                              local, agreed):
    results = [rank_results[r][name] for r in range(ranks)]
    assert [r["local_tokens"] for r in results] == local          # the outcomes differ
    hits = [r["hits"] for r in results]
    window = window_pages(agreed)
    for rank, r in enumerate(results):
        assert r["agreed_tokens"] == agreed, rank
        assert r["agreed_hits"] == [min(col) for col in zip(*hits)], rank
        # the committed SWA pages are the whole window before the commit point, all loaded
        assert r["commit_swa"] == window and set(window) <= set(r["arrived"]["swa"]), rank
        assert r["commit_full"] == list(range(agreed // PAGE_SIZE)), rank
        assert set(r["commit_full"]) <= set(r["arrived"]["full"]), rank
        # the surplus is exactly what the rank's own plan holds beyond the agreement
        assert r["surplus_full"] == [p for p in r["local_full"] if p >= agreed // PAGE_SIZE]
        assert r["surplus_swa"] == sorted(set(r["local_swa"]) - set(window)), rank
        held = sorted([["full", p] for p in r["commit_full"]] + [["swa", p] for p in window])
        assert r["held"] == held and r["intact"], rank
        for side, committed in (("full", r["commit_full"]), ("swa", window)):
            assert r["free_after_commit"][side] == r["free_at_start"][side] - len(committed)
            assert r["free_at_end"][side] == r["free_at_start"][side], (rank, side)
        assert r["host_pinned_at_end"] == 2                     # only the other request's pins


@pytest.mark.slow
def test_a_plain_minimum_would_have_committed_a_partial_window(rank_results):
    """Why the rule matters: in host-full-long the smallest local commit is 20, whose window
    (SWA pages 2-4) rank 0 never loaded."""
    rank0, rank1 = (rank_results[r]["host-full-long"] for r in (0, 1))
    smallest = min(rank0["local_tokens"], rank1["local_tokens"])
    assert smallest == 20 and not set(window_pages(smallest)) <= set(rank0["arrived"]["swa"])
