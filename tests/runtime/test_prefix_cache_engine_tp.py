"""The engine's prefix cache on 2 and 4 tensor-parallel ranks (spawned processes, gloo): the
ranks' prefetches come out differently (a torn file, an evicted file, a full host tier, a slow
rank), and every rank commits the same amount, gets the logits of a run without the cache, and
gives every page and pin back. The worker is tests/helpers/prefix_engine_tp_worker.py.

One group of 4 processes runs both scenarios (the 2-rank one on ranks 0 and 1). The pages the
ranks start from and the run without the cache are the same on every rank (the ranks hold the
same model): they are made once, here, and each rank copies the pages into its own file tier."""

import json
import os
from pathlib import Path

import pytest
import torch
from spawn_ranks import run_ranks  # tests/helpers, on the path by tests/conftest.py

import prefix_engine_tp_worker as worker

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(worker.__file__)
LOGIT_ATOL = 0.1   # the engine's eager-vs-graph tolerance (tests/runtime/test_runtime_graphs.py)

# Pass 1 caches 4 pages of 128 (540 tokens); pass 2's prompt shares 520, so a rank with every
# page commits 512 (window 256: SWA pages 2, 3).
CASES = {
    # rank 1's page 2 is torn: it commits 256; rank 0, slow, holds all and follows it
    "2-ranks-torn-and-slow": (2, {0: "slow", 1: "corrupt:2"}, 256),
    # rank 1 lost page 3: 384 (window pages 1, 2, which every rank holds); rank 2 can keep
    # only one page in host memory (served from its files anyway); rank 3 is slow
    "4-ranks-evicted-full-slow": (4, {1: "delete:3", 2: "host-full", 3: "slow"}, 384),
}


@pytest.fixture(scope="module")
def pass_one(tmp_path_factory):
    """(the file tier pass 1 leaves, the run without the cache)."""
    m = worker.model()
    pages = tmp_path_factory.mktemp("pass1") / "pages"
    worker.fill_pages(m, pages)
    return pages, worker.without_cache(m)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory, pass_one) -> list[dict]:
    """Every case on one group of 4 ranks: each rank's {case: result}."""
    out = tmp_path_factory.mktemp("ranks")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKER.parent)])
    scenarios = json.dumps([{"name": name, "ranks": world,
                             "faults": {str(r): f for r, f in faults.items()}}
                            for name, (world, faults, _) in CASES.items()])
    ranks = run_ranks(lambda rank: [str(WORKER), str(rank), "4", str(out / "init"), str(out),
                                    str(pass_one[0]), scenarios], 4, 300, env)
    failed = [(rank, log) for rank, (code, log) in enumerate(ranks) if code != 0]
    # The rank that crashed first is the one whose log does not end in a peer's disconnection.
    failed.sort(key=lambda f: "Connection closed by peer" in f[1][-600:])
    assert not failed, "\n".join(f"rank {rank}:\n{log[-3000:]}" for rank, log in failed[:2])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_commit_the_same_prefix_and_decode_as_without_the_cache(rank_results, pass_one,
                                                                     case):
    world, faults, agreed = CASES[case]
    want = pass_one[1]
    results = [r[case] for r in rank_results[:world]]
    assert all(case not in r for r in rank_results[world:])
    for rank, got in enumerate(results):
        r = {k: v for k, v in got.items() if k != "logits"}      # for the messages
        assert r["hit_tokens"] == agreed, (rank, r)
        assert r["tokens"] == want.tokens[0], (rank, r)
        diff = (torch.tensor(got["logits"]) - want.logits).abs().max()
        assert diff <= LOGIT_ATOL, (rank, float(diff), r)
        assert r["pages_given_back"] and r["pins"] == 0, (rank, r)
    assert len({tuple(r["tokens"]) for r in results}) == 1
    shorted = [r for r in results if r["fault"].startswith(("corrupt", "delete"))]
    assert shorted and all(r["short_prefetches"] == 1 for r in shorted)
