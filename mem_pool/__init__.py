"""KV memory for DeepSeek-V4: paged allocators, the SWA and compressed pools, the full->SWA
slot mapping and its identity-keyed per-step translation cache, host copies."""

import logging

from . import envs
from .disagg import PreallocBudget, PreallocLens, prealloc_kv_lens, swa_tail_len
from .dsv4_pool import DeepSeekV4TokenToKVPool, create_dsv4_kv_cache
from .host_copy import KVHostCopy
from .kv_cache_spec import CacheFootprint, KVCacheSpec, footprint
from .paged_allocator import PagedAllocator
from .swa_allocator import SWATokenToKVPoolAllocator
from .swa_loc_cache import StaleSwaLocError, SwaLocCache, SwaLocStats

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "envs",
    "PagedAllocator", "SWATokenToKVPoolAllocator",
    "KVCacheSpec", "CacheFootprint", "footprint",
    "DeepSeekV4TokenToKVPool", "create_dsv4_kv_cache",
    "SwaLocCache", "SwaLocStats", "StaleSwaLocError", "KVHostCopy",
    "swa_tail_len", "prealloc_kv_lens", "PreallocLens", "PreallocBudget",
]
