"""KV memory for DeepSeek-V4: paged allocators, the SWA and compressed pools, the full->SWA
slot mapping and its identity-keyed per-step translation cache, host copies, and a prefix KV
cache (`PrefixCache`) with its building blocks (page keys, page records, host and file tiers,
the SWA commit rule and its tensor-parallel agreement)."""

import logging

from . import envs
from .disagg import PreallocBudget, PreallocLens, prealloc_kv_lens, swa_tail_len
from .dsv4_pool import DeepSeekV4TokenToKVPool, create_dsv4_kv_cache
from .host_copy import KVHostCopy
from .kv_cache_spec import CacheFootprint, KVCacheSpec, footprint
from .paged_allocator import PagedAllocator
from .prefix import (Agreement, CommitPlan, FilePageStore, HostPageStore, PageFileError,
                     PageRecord, PageRelease, PrefixCache, PrefixCacheStats, PrefixHit,
                     agree_on_commit, boundary_state, commit_agreed, commit_plan, complete_states,
                     join_page_records, page_keys, plan_prefix_commit, record_from_bytes,
                     record_page_size, record_to_bytes, release_short_prefetch, split_host_copy,
                     swa_window_pages, with_boundary_state)
from .req_to_token_pool import ReqToTokenPool
from .swa_allocator import SWATokenToKVPoolAllocator
from .swa_loc_cache import StaleSwaLocError, SwaLocCache, SwaLocStats
from .swa_window import pages_out_of_window

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "envs",
    "PagedAllocator", "SWATokenToKVPoolAllocator", "pages_out_of_window",
    "KVCacheSpec", "CacheFootprint", "footprint",
    "DeepSeekV4TokenToKVPool", "create_dsv4_kv_cache", "ReqToTokenPool",
    "SwaLocCache", "SwaLocStats", "StaleSwaLocError", "KVHostCopy",
    "swa_tail_len", "prealloc_kv_lens", "PreallocLens", "PreallocBudget",
    # prefix KV cache and its building blocks
    "PrefixCache", "PrefixCacheStats", "PrefixHit", "complete_states",
    "page_keys", "PageRecord", "split_host_copy", "join_page_records", "boundary_state",
    "with_boundary_state", "record_page_size", "record_to_bytes", "record_from_bytes",
    "HostPageStore", "FilePageStore", "PageFileError",
    "CommitPlan", "PageRelease", "commit_plan", "plan_prefix_commit", "release_short_prefetch",
    "swa_window_pages", "Agreement", "agree_on_commit", "commit_agreed",
]
