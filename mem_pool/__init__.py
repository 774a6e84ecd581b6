"""KV memory for DeepSeek-V4: paged allocators, the SWA and compressed pools, the full->SWA
slot mapping and its identity-keyed per-step translation cache, host copies, and a prefix KV
cache (`PrefixCache`) with its building blocks (page keys, page records, host and file tiers,
the SWA commit rule and its tensor-parallel agreement)."""

import logging

from . import envs
from .disagg import PreallocBudget, PreallocLens, prealloc_kv_lens, swa_tail_len
from .dsv4_pool import DeepSeekV4TokenToKVPool, create_dsv4_kv_cache
from .file_page_store import FilePageStore
from .host_copy import KVHostCopy
from .host_page_store import HostPageStore
from .kv_cache_spec import CacheFootprint, KVCacheSpec, footprint
from .page_file_format import PageFileError
from .page_keys import page_keys
from .page_record import (PageRecord, boundary_state, join_page_records, record_from_bytes,
                          record_page_size, record_to_bytes, split_host_copy,
                          with_boundary_state)
from .paged_allocator import PagedAllocator
from .prefix_cache import PrefixCache, PrefixCacheStats, PrefixHit, complete_states
from .req_to_token_pool import ReqToTokenPool
from .swa_allocator import SWATokenToKVPoolAllocator
from .swa_loc_cache import StaleSwaLocError, SwaLocCache, SwaLocStats
from .swa_prefetch import (CommitPlan, PageRelease, commit_plan, plan_prefix_commit,
                           release_short_prefetch, swa_window_pages)
from .tp_agreement import Agreement, agree_on_commit, commit_agreed

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "envs",
    "PagedAllocator", "SWATokenToKVPoolAllocator",
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
