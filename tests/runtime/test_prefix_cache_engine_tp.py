"""The engine's prefix cache on 2 and 4 tensor-parallel ranks (spawned processes, gloo): the
ranks' prefetches come out differently (a torn file, an evicted file, a full host tier, a slow
rank), and every rank commits the same amount, gets the logits of a run without the cache, and
gives every page and pin back. The worker is tests/helpers/prefix_engine_tp_worker.py."""

import json
import os
from pathlib import Path

import pytest
from spawn_ranks import run_ranks  # tests/helpers, on the path by tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "prefix_engine_tp_worker.py"
LOGIT_ATOL = 0.1   # the engine's eager-vs-graph tolerance (tests/runtime/test_runtime_graphs.py)


def run_scenario(tmp_path: Path, world: int, faults: dict[int, str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKER.parent)])
    init = tmp_path / "init"
    ranks = run_ranks(lambda rank: [str(WORKER), str(rank), str(world), str(init), str(tmp_path),
                                    json.dumps({str(r): f for r, f in faults.items()})],
                      world, 240, env)
    failed = [(rank, log) for rank, (code, log) in enumerate(ranks) if code != 0]
    # The rank that crashed first is the one whose log does not end in a peer's disconnection.
    failed.sort(key=lambda f: "Connection closed by peer" in f[1][-600:])
    assert not failed, "\n".join(f"rank {rank}:\n{log[-3000:]}" for rank, log in failed[:2])
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


# Pass 1 caches 4 pages of 128 (540 tokens); pass 2's prompt shares 520, so a rank with every
# page commits 512 (window 256: SWA pages 2, 3).
CASES = {
    # rank 1's page 2 is torn: it commits 256; rank 0, slow, holds all and follows it
    "2-ranks-torn-and-slow": (2, {0: "slow", 1: "corrupt:2"}, 256),
    # rank 1 lost page 3: 384 (window pages 1, 2, which every rank holds); rank 2 can keep
    # only one page in host memory (served from its files anyway); rank 3 is slow
    "4-ranks-evicted-full-slow": (4, {1: "delete:3", 2: "host-full", 3: "slow"}, 384),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_commit_the_same_prefix_and_decode_as_without_the_cache(tmp_path, case):
    world, faults, agreed = CASES[case]
    results = run_scenario(tmp_path, world, faults)
    for rank, r in enumerate(results):
        assert r["hit_tokens"] == agreed, (rank, r)
        assert r["tokens"] == r["tokens_without_cache"], (rank, r)
        assert r["logit_diff"] <= LOGIT_ATOL, (rank, r)
        assert r["pages_given_back"] and r["pins"] == 0, (rank, r)
    assert len({tuple(r["tokens"]) for r in results}) == 1
    shorted = [r for r in results if r["fault"].startswith(("corrupt", "delete"))]
    assert shorted and all(r["short_prefetches"] == 1 for r in shorted)
