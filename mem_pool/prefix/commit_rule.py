"""How much of a cached prefix a request can take: the SWA all-or-nothing rule.

A cached prefix is a run of full pages. Compressed rows (C4, indexer, C128: the "full" side)
are reusable page by page, but sliding-window attention after a commit point k needs the SWA
rows of every position in [max(0, k - window), k). So a prefix can be committed at
k = j * page_size only when full pages 0..j-1 are all available AND every page overlapping
that window has its SWA rows; SWA pages before the window are never loaded. When no k > 0
qualifies nothing is committed, and no SWA page is fetched.

A prefetch that comes back short (some planned pages did not arrive: slow, corrupt, evicted)
is planned again on what arrived (possibly an earlier commit point whose window did arrive);
every arrived page the new plan does not use is released whole, so a partial window is never
committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..swa_window import pages_out_of_window


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def swa_window_pages(commit_tokens: int, page_size: int, window: int) -> range:
    """The pages overlapping [max(0, commit_tokens - window), commit_tokens): from the first
    page that has not left the window to the last page holding a committed position."""
    if commit_tokens <= 0:
        return range(0)
    return range(pages_out_of_window(commit_tokens, window, page_size),
                 -(-commit_tokens // page_size))


@dataclass(frozen=True)
class CommitPlan:
    """Commit the first `commit_tokens` positions: full pages 0..j-1 and the SWA pages of the
    window before the commit point (page indices within the prefix)."""
    commit_tokens: int
    full_pages: tuple[int, ...]
    swa_pages: tuple[int, ...]
    page_size: int
    window: int

    def __post_init__(self) -> None:
        _check_positive("page_size", self.page_size)
        _check_positive("window", self.window)
        if self.commit_tokens < 0 or self.commit_tokens % self.page_size:
            raise ValueError(f"commit_tokens={self.commit_tokens} must be a multiple of "
                             f"page_size={self.page_size} and >= 0")
        if self.full_pages != tuple(range(self.num_pages)) or self.swa_pages != tuple(
                swa_window_pages(self.commit_tokens, self.page_size, self.window)):
            raise ValueError(f"a plan committing {self.commit_tokens} tokens takes full pages "
                             f"0..{self.num_pages - 1} and exactly the SWA pages of the window "
                             f"before it; got {self.full_pages} and {self.swa_pages}")

    @property
    def num_pages(self) -> int:
        return self.commit_tokens // self.page_size

    @property
    def swa_start_page(self) -> int:
        """The first SWA page the plan holds (0 when it holds none)."""
        return self.swa_pages[0] if self.swa_pages else 0


def commit_plan(commit_tokens: int, page_size: int, window: int) -> CommitPlan:
    """The plan that commits `commit_tokens` (a multiple of page_size)."""
    _check_positive("page_size", page_size)
    _check_positive("window", window)
    pages = commit_tokens // page_size if commit_tokens > 0 else 0
    return CommitPlan(commit_tokens, tuple(range(pages)),
                      tuple(swa_window_pages(commit_tokens, page_size, window)), page_size,
                      window)


@dataclass(frozen=True)
class PageRelease:
    """Loaded pages (indices within the prefix) to give back, by side."""
    full_pages: tuple[int, ...] = ()
    swa_pages: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.full_pages or self.swa_pages)


def plan_prefix_commit(full_pages_available: Sequence[bool], swa_pages_available: Sequence[bool],
                       page_size: int, window: int) -> CommitPlan:
    """The largest commit point allowed by per-page availability (in prefix order)."""
    _check_positive("page_size", page_size)
    _check_positive("window", window)
    if len(full_pages_available) != len(swa_pages_available):
        raise ValueError(f"full_pages_available has {len(full_pages_available)} pages, "
                         f"swa_pages_available {len(swa_pages_available)}")
    best, swa_run = 0, 0          # swa_run: available SWA pages ending at page j - 1
    for j in range(1, len(full_pages_available) + 1):
        if not full_pages_available[j - 1]:
            break
        swa_run = swa_run + 1 if swa_pages_available[j - 1] else 0
        if swa_run >= len(swa_window_pages(j * page_size, page_size, window)):
            best = j
    return commit_plan(best * page_size, page_size, window)


def _arrived(name: str, pages: Iterable[int], planned: tuple[int, ...]) -> set[int]:
    got = set(pages)
    stray = sorted(got - set(planned))
    if stray:
        raise ValueError(f"{name} holds pages {stray} the plan did not load")
    return got


def release_short_prefetch(plan: CommitPlan, arrived_full: Iterable[int],
                           arrived_swa: Iterable[int]) -> tuple[CommitPlan, PageRelease]:
    """Plan again on the pages that arrived (indices within the prefix); returns the new plan
    and the arrived pages it does not use, to release. SWA rows may arrive for any planned
    page, not only the plan's window (a tier that keeps a page's families together hands them
    over together), so a short window can fall back to an earlier one that arrived whole."""
    full = _arrived("arrived_full", arrived_full, plan.full_pages)
    swa = _arrived("arrived_swa", arrived_swa, plan.full_pages)
    pages = range(plan.num_pages)
    new = plan_prefix_commit([p in full for p in pages], [p in swa for p in pages],
                             plan.page_size, plan.window)
    return new, PageRelease(tuple(sorted(full - set(new.full_pages))),
                            tuple(sorted(swa - set(new.swa_pages))))
