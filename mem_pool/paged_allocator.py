"""A paged token-slot allocator: hands out whole pages, returns token locations.

Locations are `page * page_size + offset`. Page 0 is never handed out: it is the dummy target of
padded rows (location 0). Bookkeeping lives on the host (pass host tensors or lists for lengths
and last locations: device tensors cost a host sync); returned locations are int64 tensors on
the allocator's device. A request's positions are page-aligned: position p sits at in-page
offset p % page_size, so an extend continues the prefix's last page right after `last_loc`.
The allocator records how far each page has been handed out, so `last_loc` must be the last
location handed out on its page: two allocations continuing from the same `last_loc` (which
would hand one slot out twice) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .loc_checks import check_range, host_int64, host_ints


def ceil_div(a, b):
    return -(-a // b)


def check_need_size(need_size, page_size: int) -> None:
    """need_size must be a positive int multiple of page_size (nothing is taken otherwise)."""
    if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 1:
        raise ValueError(f"need_size must be a positive int, got {need_size!r}")
    if need_size % page_size:
        raise ValueError(f"need_size={need_size} must be a multiple of page_size={page_size}")


def to_device_versioned(locs: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fresh copy on `device` that is a normal tensor even under inference_mode: the SWA
    location cache keys on its version counter."""
    with torch.inference_mode(False):
        return locs.to(device, copy=True)


@dataclass(frozen=True)
class ExtendPlan:
    """Validated per-request lengths of an extend (host ints) and the new pages it needs."""
    prefix_lens: torch.Tensor
    seq_lens: torch.Tensor
    last_loc: torch.Tensor
    num_new_pages: int

    def continued_rows(self, page_size: int) -> torch.Tensor:
        """Rows whose prefix ends inside a page (the extend fills that page first)."""
        return (self.prefix_lens % page_size != 0) & (self.seq_lens > self.prefix_lens)

    def locations(self, new_pages: torch.Tensor, page_size: int) -> torch.Tensor:
        """Token locations of every extended position, request by request (host int64)."""
        out, used = [], 0
        offsets = torch.arange(page_size, dtype=torch.int64)
        for p, s, last in zip(self.prefix_lens.tolist(), self.seq_lens.tolist(),
                              self.last_loc.tolist()):
            fill_end = min(s, ceil_div(p, page_size) * page_size)
            if fill_end > p:
                out.append(torch.arange(last + 1, last + 1 + fill_end - p, dtype=torch.int64))
            k = ceil_div(s, page_size) - ceil_div(p, page_size)
            if k:
                pages = new_pages[used:used + k]
                used += k
                out.append((pages[:, None] * page_size + offsets).flatten()[:s - fill_end])
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)


def plan_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens: int,
                page_size: int) -> ExtendPlan:
    p = host_int64("prefix_lens", prefix_lens)
    s = host_int64("seq_lens", seq_lens)
    last = host_int64("last_loc", last_loc)
    if not (p.numel() == s.numel() == last.numel()):
        raise ValueError(f"prefix_lens, seq_lens and last_loc must have one entry per request, got "
                         f"{p.numel()}, {s.numel()} and {last.numel()}")
    if (p < 0).any() or (s < p).any():
        i = int(torch.nonzero((p < 0) | (s < p))[0])
        raise ValueError(f"seq_lens[{i}]={int(s[i])} must be >= prefix_lens[{i}]={int(p[i])} >= 0")
    if int((s - p).sum()) != extend_num_tokens:
        raise ValueError(f"extend_num_tokens={extend_num_tokens} but seq_lens - prefix_lens sums "
                         f"to {int((s - p).sum())}")
    plan = ExtendPlan(p, s, last, int((ceil_div(s, page_size) - ceil_div(p, page_size)).sum()))
    rows = plan.continued_rows(page_size)
    bad = rows & ((last + 1) % page_size != p % page_size)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"last_loc[{i}]={int(last[i])} must sit at in-page offset "
                         f"(prefix_lens[{i}] - 1) % page_size = {(int(p[i]) - 1) % page_size}")
    return plan


def plan_decode(seq_lens, last_loc, page_size: int) -> tuple[list[bool], list[int]]:
    """(rows that start a new page, last_loc) for one new token per request, as host lists (a
    decode step's few rows: plain ints, no tensor op)."""
    s = host_ints("seq_lens", seq_lens)
    last = host_ints("last_loc", last_loc)
    if len(s) != len(last):
        raise ValueError(f"seq_lens and last_loc must have one entry per request, got "
                         f"{len(s)} and {len(last)}")
    if s and min(s) < 1:
        raise ValueError(f"seq_lens (lengths including the new token) must be >= 1, got "
                         f"{min(s)}")
    new_page = [(n - 1) % page_size == 0 for n in s]
    for i, (n, loc, new) in enumerate(zip(s, last, new_page)):
        if not new and (loc + 1) % page_size != (n - 1) % page_size:
            raise ValueError(f"last_loc[{i}]={loc} must sit at in-page offset "
                             f"(seq_lens[{i}] - 2) % page_size = {(n - 2) % page_size}")
    return new_page, last


def decode_locations(new_page: list[bool], last: list[int], pages: list[int],
                     page_size: int) -> list[int]:
    """Each row's next location: its page's next slot, or the start of its new page (pages
    taken in row order)."""
    fresh = iter(pages)
    return [next(fresh) * page_size if new else loc + 1 for new, loc in zip(new_page, last)]


class PagedAllocator:
    """Pages 1..size/page_size of a pool of `size` tokens (+ the reserved page 0)."""

    def __init__(self, size: int, page_size: int, device: torch.device | str = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(f"size={size} must be a positive multiple of page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self.clear()

    # ---- pages (host) ---------------------------------------------------------------------

    def clear(self) -> None:
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._page_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._page_free[0] = False
        # Locations handed out on each page: offsets 0.._page_fill[page]-1.
        self._page_fill = torch.zeros(self.num_pages + 1, dtype=torch.int64)
        self.last_handed_out = torch.empty(0, dtype=torch.int64)

    def available_pages(self) -> int:
        return self._free_pages.numel()

    def available_size(self) -> int:
        return self.available_pages() * self.page_size

    def alloc_pages(self, k: int) -> torch.Tensor | None:
        """k free pages (host int64), or None (nothing taken) when fewer are free."""
        if k < 0:
            raise ValueError(f"a page count must be >= 0, got {k}")
        if k > self._free_pages.numel():
            return None
        pages, self._free_pages = self._free_pages[:k], self._free_pages[k:]
        if k:
            self._page_free[pages] = False
        return pages

    def check_in_use(self, name: str, pages: torch.Tensor) -> None:
        """Raise naming `name` unless every page is a handed-out page."""
        check_range(f"{name} (as pages)", pages, 1, self.num_pages + 1)
        free = self._page_free[pages]
        if free.any():
            raise ValueError(f"{name} refers to page {int(pages[free][0])}, which is not "
                             "allocated (already freed or never handed out)")

    def check_continues(self, name: str, last_loc: list[int]) -> None:
        """Each location of last_loc (host ints) is the last one handed out on its allocated
        page, and no page is continued twice: otherwise the new locations would already be
        someone's."""
        if not last_loc:
            return
        pages = [loc // self.page_size for loc in last_loc]
        if min(pages) < 1 or max(pages) > self.num_pages:
            bad = min(pages) if min(pages) < 1 else max(pages)
            raise IndexError(f"{name} (as pages) holds {bad}; valid values are "
                             f"1..{self.num_pages}")
        page_free, page_fill = self._page_free.numpy(), self._page_fill.numpy()
        for page in pages:
            if page_free[page]:
                raise ValueError(f"{name} refers to page {page}, which is not allocated "
                                 "(already freed or never handed out)")
        for i, (loc, page) in enumerate(zip(last_loc, pages)):
            taken = int(page_fill[page])
            if taken != loc % self.page_size + 1:
                raise ValueError(f"{name}[{i}]={loc} is not the last location handed out on "
                                 f"page {page} (offsets 0..{taken - 1} are taken): its next "
                                 "location already belongs to an earlier allocation")
        if len(set(pages)) != len(pages):
            raise ValueError(f"{name} continues one page from two rows; each would take the "
                             "same next location")

    def hand_out(self, locs: torch.Tensor) -> torch.Tensor:
        """Record host locations as handed out (each page's fill) and return them on device.
        `last_handed_out` keeps the host copy: a caller keeping host-side block tables reads it
        instead of copying the result back from the device."""
        self.last_handed_out = locs
        if locs.numel():
            self._page_fill.scatter_reduce_(0, locs // self.page_size,
                                            locs % self.page_size + 1, "amax")
        return to_device_versioned(locs, self.device)

    def hand_out_rows(self, locs: list[int], to_device: bool = True):
        """hand_out of a decode step's few locations, given as host ints: each page's fill
        raised one by one (no tensor op); returns them on device, or (to_device=False) the
        host ints themselves, for a caller that copies them with its other step inputs."""
        page_fill = self._page_fill.numpy()
        for loc in locs:
            page, filled = divmod(loc, self.page_size)
            page_fill[page] = max(int(page_fill[page]), filled + 1)
        self.last_handed_out = torch.tensor(locs, dtype=torch.int64)
        return to_device_versioned(self.last_handed_out, self.device) if to_device else locs

    def free_pages(self, pages: torch.Tensor, name: str = "pages") -> None:
        pages = torch.unique(pages)
        self.check_in_use(name, pages)
        self._page_free[pages] = True
        self._page_fill[pages] = 0
        self._free_pages = torch.cat([self._free_pages, pages])

    def backup_state(self):
        return self._free_pages.clone(), self._page_free.clone(), self._page_fill.clone()

    def restore_state(self, state) -> None:
        free_pages, page_free, page_fill = state
        self._free_pages, self._page_free = free_pages.clone(), page_free.clone()
        self._page_fill = page_fill.clone()

    # ---- token locations ------------------------------------------------------------------

    def check_locations(self, name: str, locs: torch.Tensor) -> None:
        """Host locations on handed-out pages (page 0, the dummy, is never one)."""
        check_range(name, locs, self.page_size, (self.num_pages + 1) * self.page_size)

    def page_locations(self, pages: torch.Tensor) -> torch.Tensor:
        """Every token location of `pages` (host int64)."""
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """need_size (a positive multiple of page_size) locations on fresh pages, or None."""
        check_need_size(need_size, self.page_size)
        pages = self.alloc_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self.hand_out(self.page_locations(pages))

    def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens: int):
        """Locations of positions prefix_lens[i]..seq_lens[i]-1 of each request, or None."""
        plan = plan_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens, self.page_size)
        self.check_continues("last_loc",
                             plan.last_loc[plan.continued_rows(self.page_size)].tolist())
        pages = self.alloc_pages(plan.num_new_pages)
        if pages is None:
            return None
        return self.hand_out(plan.locations(pages, self.page_size))

    def alloc_decode(self, seq_lens, last_loc, to_device: bool = True):
        """One location per request for position seq_lens[i]-1, or None (to_device: see
        hand_out_rows)."""
        new_page, last = plan_decode(seq_lens, last_loc, self.page_size)
        self.check_continues("last_loc", [loc for new, loc in zip(new_page, last) if not new])
        pages = self.alloc_pages(sum(new_page))
        if pages is None:
            return None
        locs = decode_locations(new_page, last, pages.tolist() if pages.numel() else [],
                                self.page_size)
        return self.hand_out_rows(locs, to_device)

    def free(self, free_index) -> None:
        """Free every page that holds a location of free_index."""
        locs = host_int64("free_index", free_index)
        self.check_locations("free_index", locs)
        if locs.numel():
            self.free_pages(locs // self.page_size, "free_index")
