"""Disaggregated decode: preallocating a transferred request's KV on the decode side.

The decode side receives the whole prompt's compressed KV (full pool) but only the sliding
window's SWA KV, so only the SWA tail is preallocated: the positions after the pages that left
the window (`pages_out_of_window`),

    tail = seq_len - floor_to_page(max(0, seq_len - window))

The tail starts on a page boundary, so it takes whole SWA pages
(`SWATokenToKVPoolAllocator.alloc_extend_swa_tail(seq_len, tail)`). Full and SWA budgets are
checked separately, each charged in the whole pages the allocator takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .paged_allocator import ceil_div
from .swa_window import pages_out_of_window


def swa_tail_len(seq_len: int, window: int, page_size: int) -> int:
    """SWA tokens to preallocate for a request of seq_len tokens."""
    return seq_len - pages_out_of_window(seq_len, window, page_size) * page_size


@dataclass(frozen=True)
class PreallocLens:
    full_len: int   # tokens of the full pool (the whole sequence)
    swa_len: int    # tokens of the SWA pool (the tail)

    def charge(self, page_size: int) -> tuple[int, int]:
        """(full, SWA) tokens the allocator takes: whole pages on both sides."""
        return (ceil_div(self.full_len, page_size) * page_size,
                ceil_div(self.swa_len, page_size) * page_size)


def prealloc_kv_lens(seq_len: int, window: int, page_size: int) -> PreallocLens:
    return PreallocLens(seq_len, swa_tail_len(seq_len, window, page_size))


@dataclass
class PreallocBudget:
    """Tokens still free on each side for preallocation."""
    full_tokens: int
    swa_tokens: int
    page_size: int

    @classmethod
    def from_allocator(cls, allocator) -> "PreallocBudget":
        return cls(allocator.full_available_size(), allocator.swa_available_size(),
                   allocator.page_size)

    def try_reserve(self, seq_len: int, window: int) -> PreallocLens | None:
        """Reserve a request's charge on both sides, or nothing (None) if either lacks room."""
        lens = prealloc_kv_lens(seq_len, window, self.page_size)
        full, swa = lens.charge(self.page_size)
        if full > self.full_tokens or swa > self.swa_tokens:
            return None
        self.full_tokens -= full
        self.swa_tokens -= swa
        return lens
