"""Agreeing on a prefix commit across tensor-parallel ranks with one collective.

Each rank prefetches its own copy of a cached prefix and may get less than the others (a slow
load, a corrupt file, a full host tier). Before anything is committed the ranks agree, with
ONE all_reduce(MIN) of one int64 tensor:

    [completed_tokens, -swa_start_page, hit_pages[0], ..., hit_pages[n-1]]

completed_tokens is the rank's local plan's commit point; swa_start_page the first page of the
run of SWA pages it holds up to that point (negated, so MIN gives the latest start of any
rank): by default its plan's window, or earlier when the rank holds more (`swa_held_from`: a
tier that keeps a page's families together fetches SWA rows with every page); hit_pages the
caller's per-sidecar pool hit counts (the same number of pools on every rank), agreed as their
minimum.

The agreed commit point is the smallest completed_tokens, provided every rank holds the SWA
window before it; otherwise 0. A rank holds SWA pages swa_start_page..j-1 (the window of its
own plan), and the window before a smaller commit point starts no later, so it is covered on
every rank exactly when it starts at or after the latest swa_start_page. Every rank computes the
same answer from the same reduced tensor, then commits exactly that (`commit_agreed`) and
releases what it loaded beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .commit_rule import CommitPlan, PageRelease, commit_plan, swa_window_pages


@dataclass(frozen=True)
class Agreement:
    commit_tokens: int            # what every rank commits
    completed_tokens: int         # the smallest local commit point
    swa_start_page: int           # the latest first SWA page held by a rank
    hit_pages: tuple[int, ...]    # per sidecar pool, the smallest count


def _held_from(local_plan: CommitPlan, swa_held_from: int | None) -> int:
    if swa_held_from is None:
        return local_plan.swa_start_page
    if not 0 <= swa_held_from <= local_plan.swa_start_page:
        raise ValueError(f"swa_held_from={swa_held_from}: the rank holds SWA pages from there up "
                         f"to its commit point, so it must be in 0..{local_plan.swa_start_page} "
                         "(the plan's own window start)")
    return swa_held_from


def pack_outcome(local_plan: CommitPlan, hit_pages: Sequence[int],
                 swa_held_from: int | None = None) -> torch.Tensor:
    """The rank's int64 contribution to the all_reduce(MIN)."""
    return torch.tensor([local_plan.commit_tokens, -_held_from(local_plan, swa_held_from),
                         *(int(h) for h in hit_pages)], dtype=torch.int64)


def agreement_from_reduced(reduced: torch.Tensor, page_size: int, window: int) -> Agreement:
    """The agreement every rank reads off the MIN-reduced tensor."""
    values = reduced.tolist()
    completed, swa_start = values[0], -values[1]
    window_start = swa_window_pages(completed, page_size, window)
    ok = completed == 0 or window_start[0] >= swa_start
    return Agreement(completed if ok else 0, completed, swa_start, tuple(values[2:]))


def _needs_collective(group) -> bool:
    if group is None:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a process group was given but torch.distributed is not initialized")
    return dist.get_world_size(group) > 1


def agree_on_commit(local_plan: CommitPlan, hit_pages: Sequence[int],
                    group=None, swa_held_from: int | None = None) -> Agreement:
    """The commit every rank of `group` makes. group=None (no tensor parallelism) or a group
    of one rank: the local plan, with no collective. swa_held_from: the first of the SWA pages
    the rank holds without a gap up to its commit point (default: its plan's window start)."""
    packed = pack_outcome(local_plan, hit_pages, swa_held_from)
    if _needs_collective(group):
        dist.all_reduce(packed, op=dist.ReduceOp.MIN, group=group)
    return agreement_from_reduced(packed, local_plan.page_size, local_plan.window)


def commit_agreed(local_plan: CommitPlan, agreed: Agreement,
                  swa_held_from: int | None = None) -> tuple[CommitPlan, PageRelease]:
    """(what this rank commits, what it loaded beyond the agreement and must release: of
    its plan's pages; SWA pages held before the plan's window are the caller's to release)."""
    commit = commit_plan(agreed.commit_tokens, local_plan.page_size, local_plan.window)
    held_swa = range(_held_from(local_plan, swa_held_from), local_plan.num_pages)
    missing_full = set(commit.full_pages) - set(local_plan.full_pages)
    missing_swa = set(commit.swa_pages) - set(held_swa)
    if missing_full or missing_swa:
        raise ValueError(f"the agreement commits {agreed.commit_tokens} tokens but this rank "
                         f"lacks full pages {sorted(missing_full)} and SWA pages "
                         f"{sorted(missing_swa)} (an agreement from other ranks' plans?)")
    kept_full, kept_swa = set(commit.full_pages), set(commit.swa_pages)
    return commit, PageRelease(tuple(p for p in local_plan.full_pages if p not in kept_full),
                               tuple(p for p in local_plan.swa_pages if p not in kept_swa))
