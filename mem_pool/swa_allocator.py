"""The two-sided allocator of DeepSeek-V4: full-pool token slots plus sliding-window (SWA) slots.

Every full page either has one SWA page or none, and an SWA page belongs to at most one full
page; tokens keep their in-page offset on both sides. `full_to_swa_index_mapping[full_loc]` is
the SWA slot (0 = none), with a trailing -1 so that translating -1 gives -1. The mapping tensor
keeps its storage for the allocator's lifetime (graphs read it by address): every mutation
writes it in place and bumps the pool's mapping generation. Every call checks both sides before
taking either, so a failed call returns None and leaks nothing.
"""

from __future__ import annotations

import logging

import torch

from .loc_checks import host_int64, whole_pages
from .paged_allocator import (PagedAllocator, ceil_div, check_need_size, decode_locations,
                              plan_decode, plan_extend)
from .swa_window import pages_out_of_window

logger = logging.getLogger(__name__)


class SWATokenToKVPoolAllocator:
    def __init__(self, size_full: int, size_swa: int, page_size: int, kvcache,
                 device: torch.device | str = "cpu"):
        self.page_size = page_size
        self.device = torch.device(device)
        self.full_attn_allocator = PagedAllocator(size_full, page_size, self.device)
        self.swa_attn_allocator = PagedAllocator(size_swa, page_size, self.device)
        n_full = self.full_attn_allocator.num_pages + 1
        # Host page maps: the truth the device mapping is written from.
        self._swa_page_of_full = torch.zeros(n_full, dtype=torch.int64)
        self._full_page_of_swa = torch.zeros(self.swa_attn_allocator.num_pages + 1,
                                             dtype=torch.int64)
        with torch.inference_mode(False):  # keep a version counter, see SwaLocCache
            self.full_to_swa_index_mapping = torch.zeros(n_full * page_size + 1,
                                                         dtype=torch.int64, device=self.device)
            self.full_to_swa_index_mapping[-1] = -1
        self._kvcache = kvcache
        kvcache.register_mapping(self.full_to_swa_index_mapping)

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def size_full(self) -> int:
        return self.full_attn_allocator.size

    @property
    def size_swa(self) -> int:
        return self.swa_attn_allocator.size

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    @property
    def last_handed_out(self) -> torch.Tensor:
        """Host int64 copy of the locations the latest allocation returned."""
        return self.full_attn_allocator.last_handed_out

    # ---- the page maps and the device mapping -----------------------------------------------

    def _write_mapping(self, full_pages: torch.Tensor) -> None:
        """Rewrite the device mapping of every token of `full_pages` from the host page map."""
        if full_pages.numel() == 0:
            return
        locs = self.full_attn_allocator.page_locations(full_pages)
        swa_pages = self._swa_page_of_full[locs // self.page_size]
        values = torch.where(swa_pages > 0, swa_pages * self.page_size + locs % self.page_size, 0)
        self.full_to_swa_index_mapping[locs.to(self.device)] = values.to(self.device)

    def _link(self, full_pages: torch.Tensor, swa_pages: torch.Tensor) -> None:
        self._swa_page_of_full[full_pages] = swa_pages
        self._full_page_of_swa[swa_pages] = full_pages
        self._write_mapping(full_pages)

    def _unlink(self, full_pages: torch.Tensor) -> torch.Tensor:
        """Drop the SWA pages of `full_pages` from the maps; returns those SWA pages."""
        swa_pages = self._swa_page_of_full[full_pages]
        swa_pages = swa_pages[swa_pages > 0]
        self._full_page_of_swa[swa_pages] = 0
        self._swa_page_of_full[full_pages] = 0
        self._write_mapping(full_pages)
        return swa_pages

    def _mapping_changed(self) -> None:
        self._kvcache.bump_mapping_generation()

    def _take_pages(self, n_full: int, n_swa: int):
        """n_full and n_swa fresh pages, or None with nothing taken."""
        if (n_full > self.full_attn_allocator.available_pages()
                or n_swa > self.swa_attn_allocator.available_pages()):
            return None
        return (self.full_attn_allocator.alloc_pages(n_full),
                self.swa_attn_allocator.alloc_pages(n_swa))

    def _check_continued(self, last_loc: list[int]) -> None:
        """The pages an allocation continues (last_loc: host ints) are allocated and still have
        their SWA page."""
        self.full_attn_allocator.check_continues("last_loc", last_loc)
        swa_page_of_full = self._swa_page_of_full.numpy()
        for loc in last_loc:
            if swa_page_of_full[loc // self.page_size] == 0:
                raise ValueError(f"last_loc={loc} is on a page whose SWA page was freed; an "
                                 "allocation cannot continue it")

    # ---- allocation -----------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        check_need_size(need_size, self.page_size)
        k = need_size // self.page_size
        taken = self._take_pages(k, k)
        if taken is None:
            return None
        self._link(*taken)
        self._mapping_changed()
        return self.full_attn_allocator.hand_out(
            self.full_attn_allocator.page_locations(taken[0]))

    def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens: int):
        plan = plan_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens, self.page_size)
        self._check_continued(plan.last_loc[plan.continued_rows(self.page_size)].tolist())
        taken = self._take_pages(plan.num_new_pages, plan.num_new_pages)
        if taken is None:
            return None
        self._link(*taken)
        self._mapping_changed()
        return self.full_attn_allocator.hand_out(plan.locations(taken[0], self.page_size))

    def alloc_decode(self, seq_lens, last_loc, to_device: bool = True):
        """One location per request for position seq_lens[i]-1, or None; to_device=False
        returns them as host ints (`PagedAllocator.hand_out_rows`). A step that opens no page
        changes no map."""
        new_page, last = plan_decode(seq_lens, last_loc, self.page_size)
        self._check_continued([loc for new, loc in zip(new_page, last) if not new])
        k = sum(new_page)
        taken = self._take_pages(k, k)
        if taken is None:
            return None
        if k:
            self._link(*taken)
            self._mapping_changed()
        locs = decode_locations(new_page, last, taken[0].tolist() if k else [], self.page_size)
        return self.full_attn_allocator.hand_out_rows(locs, to_device)

    def alloc_extend_swa_tail(self, seq_len: int, swa_tail_len: int):
        """A new request of seq_len tokens with SWA slots only for its last swa_tail_len tokens
        (disaggregated decode). The tail must start on a page boundary, so it takes whole SWA
        pages (see `disagg.swa_tail_len`)."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0 <= swa_tail_len <= seq_len or (seq_len - swa_tail_len) % self.page_size:
            raise ValueError(f"swa_tail_len={swa_tail_len} must be in 0..seq_len={seq_len} with "
                             f"seq_len - swa_tail_len a multiple of page_size={self.page_size}")
        n_full, n_swa = ceil_div(seq_len, self.page_size), ceil_div(swa_tail_len, self.page_size)
        taken = self._take_pages(n_full, n_swa)
        if taken is None:
            return None
        full_pages, swa_pages = taken
        self._link(full_pages[n_full - n_swa:], swa_pages)
        self._mapping_changed()
        locs = self.full_attn_allocator.page_locations(full_pages)[:seq_len]
        return self.full_attn_allocator.hand_out(locs)

    # ---- freeing --------------------------------------------------------------------------

    def free(self, free_index) -> None:
        """Free every full page holding a location of free_index, and its SWA page."""
        locs = host_int64("free_index", free_index)
        if locs.numel() == 0:
            return
        self.full_attn_allocator.check_locations("free_index", locs)
        pages = torch.unique(locs // self.page_size)
        self.full_attn_allocator.check_in_use("free_index", pages)
        self.swa_attn_allocator.free_pages(self._unlink(pages), "free_index")
        self.full_attn_allocator.free_pages(pages, "free_index")
        self._mapping_changed()

    def free_swa(self, free_index) -> None:
        """Free the SWA pages of the full pages free_index covers (whole pages); full pages stay.
        Pages that already have no SWA page are skipped."""
        locs = host_int64("free_index", free_index)
        if locs.numel() == 0:
            return
        self.full_attn_allocator.check_locations("free_index", locs)
        pages = whole_pages("free_index", locs, self.page_size)
        self.full_attn_allocator.check_in_use("free_index", pages)
        self.swa_attn_allocator.free_pages(self._unlink(pages), "free_index")
        self._mapping_changed()

    def free_swa_out_of_window(self, req_full_loc, seq_len: int, window: int) -> int:
        """Free the SWA pages of the request's pages that left the window for good
        (`pages_out_of_window`). req_full_loc holds the request's full locations by position (at
        least those pages' positions). Returns the number of SWA pages freed."""
        n = pages_out_of_window(seq_len, window, self.page_size) * self.page_size
        locs = host_int64("req_full_loc", req_full_loc)
        if n == 0:
            return 0
        if locs.numel() < n:
            raise ValueError(f"req_full_loc has {locs.numel()} locations but positions 0..{n - 1} "
                             f"leave the window (seq_len={seq_len}, window={window})")
        by_page = locs[:n].view(-1, self.page_size)
        if (by_page[:, 0] % self.page_size != 0).any() or (
                by_page != by_page[:, :1] + torch.arange(self.page_size)).any():
            raise ValueError(f"req_full_loc must be page-aligned by position (position p at "
                             f"in-page offset p % page_size={self.page_size})")
        pages = by_page[:, 0] // self.page_size
        self.full_attn_allocator.check_locations("req_full_loc", by_page[:, 0])
        self.full_attn_allocator.check_in_use("req_full_loc", pages)
        pages = pages[self._swa_page_of_full[pages] > 0]
        if pages.numel() == 0:
            return 0
        self.swa_attn_allocator.free_pages(self._unlink(pages), "req_full_loc")
        self._mapping_changed()
        return pages.numel()

    # ---- mapping updates from outside (host-cache load-back) --------------------------------

    def set_full_to_swa_mapping(self, full_indices, swa_indices) -> None:
        """Map full locations to SWA slots the caller allocated (swa_attn_allocator.alloc).

        Mapping is per page: each listed full page maps to one SWA page with equal in-page
        offsets, and a full page that already has a different SWA page raises."""
        full = host_int64("full_indices", full_indices)
        swa = host_int64("swa_indices", swa_indices)
        if full.numel() != swa.numel():
            raise ValueError(f"full_indices and swa_indices must have the same length, got "
                             f"{full.numel()} and {swa.numel()}")
        if full.numel() == 0:
            return
        p = self.page_size
        self.full_attn_allocator.check_locations("full_indices", full)
        self.swa_attn_allocator.check_locations("swa_indices", swa)
        if (full % p != swa % p).any():
            raise ValueError(f"swa_indices must keep the in-page offset (loc % page_size={p}) of "
                             "full_indices")
        pairs = torch.unique(torch.stack([full // p, swa // p], 1), dim=0)
        full_pages, swa_pages = pairs[:, 0], pairs[:, 1]
        if torch.unique(full_pages).numel() != pairs.shape[0] or (
                torch.unique(swa_pages).numel() != pairs.shape[0]):
            raise ValueError("full_indices and swa_indices must pair pages one to one")
        self.full_attn_allocator.check_in_use("full_indices", full_pages)
        self.swa_attn_allocator.check_in_use("swa_indices", swa_pages)
        old_swa = self._swa_page_of_full[full_pages]
        old_full = self._full_page_of_swa[swa_pages]
        if ((old_swa != 0) & (old_swa != swa_pages)).any() or (
                (old_full != 0) & (old_full != full_pages)).any():
            raise ValueError("set_full_to_swa_mapping would remap a page that is already mapped "
                             "elsewhere; free_swa it first")
        self._link(full_pages, swa_pages)
        self._mapping_changed()

    # ---- whole-state operations -----------------------------------------------------------

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self._swa_page_of_full.zero_()
        self._full_page_of_swa.zero_()
        self.full_to_swa_index_mapping[:-1].fill_(0)
        self._mapping_changed()

    def backup_state(self):
        return (self.full_attn_allocator.backup_state(), self.swa_attn_allocator.backup_state(),
                self._swa_page_of_full.clone(), self._full_page_of_swa.clone())

    def restore_state(self, state) -> None:
        full_state, swa_state, swa_page_of_full, full_page_of_swa = state
        changed = torch.nonzero(swa_page_of_full != self._swa_page_of_full).flatten()
        self.full_attn_allocator.restore_state(full_state)
        self.swa_attn_allocator.restore_state(swa_state)
        self._swa_page_of_full.copy_(swa_page_of_full)
        self._full_page_of_swa.copy_(full_page_of_swa)
        self._write_mapping(changed)
        self._mapping_changed()
