"""The prefix KV cache (`PrefixCache`) and its building blocks: chained page keys, page records
(a page's bytes of every cache family), the host and file tiers, the commit rule (SWA
all-or-nothing over one window) and the tensor-parallel agreement on a commit."""

from .cache import PrefixCache, PrefixCacheStats, PrefixHit, complete_states
from .commit_rule import (CommitPlan, PageRelease, commit_plan, plan_prefix_commit,
                          release_short_prefetch, swa_window_pages)
from .file_page_store import FilePageStore
from .host_page_store import HostPageStore
from .page_file_format import PageFileError
from .page_keys import page_keys
from .page_record import (PageRecord, boundary_state, join_page_records, record_from_bytes,
                          record_page_size, record_to_bytes, split_host_copy,
                          with_boundary_state)
from .tp_agreement import Agreement, agree_on_commit, commit_agreed

__all__ = [
    "PrefixCache", "PrefixCacheStats", "PrefixHit", "complete_states",
    "page_keys", "PageRecord", "split_host_copy", "join_page_records", "boundary_state",
    "with_boundary_state", "record_page_size", "record_to_bytes", "record_from_bytes",
    "HostPageStore", "FilePageStore", "PageFileError",
    "CommitPlan", "PageRelease", "commit_plan", "plan_prefix_commit", "release_short_prefetch",
    "swa_window_pages", "Agreement", "agree_on_commit", "commit_agreed",
]
