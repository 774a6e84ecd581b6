"""The prefix KV cache: whole pages of earlier prompts, found by their token ids, kept in host
memory and optionally on local disk, and handed back under the SWA all-or-nothing rule.

Pages are named by chained keys (`page_keys`): the key of page i names the whole prefix up to
the end of that page, so the keys form a radix tree over page-sized token runs, flattened into
a dict. Each page is a `PageRecord` holding the V4 bytes of every cache family (SWA, C4,
indexer, C128: copied, never re-quantized) and the ratio-4 compressors' state rings at the end
of the page, which a request resuming there needs. Tiers, searched in this order:

1. the device pool: the running requests' own pages (not shared between requests here);
2. `HostPageStore`, least recently used out first;
3. `FilePageStore` (optional): crash-safe files with checksums, written through on insert, so
   a restarted process finds them; a corrupt or torn file is a logged miss.

`match` is the admission path: it plans the largest commit point the tiers' contents allow
(`plan_prefix_commit`), prefetches those pages (host hits pinned while in use, file hits
promoted to the host tier), plans again on what actually arrived (`release_short_prefetch`:
a short SWA window is released whole, never partly committed), agrees with the other
tensor-parallel ranks in one all_reduce(MIN) (`agree_on_commit`), and returns the agreed pages
joined into one `KVHostCopy` ready for `load_cpu_copy`. The C128 compressors need no state at a
page boundary (pages hold whole 128-token windows, so the next window starts fresh): their
rings are handed back cleared, as a new request's are.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from ..host_copy import KVHostCopy
from .commit_rule import CommitPlan, commit_plan, plan_prefix_commit, release_short_prefetch
from .file_page_store import FilePageStore
from .host_page_store import HostPageStore
from .page_keys import page_keys
from .page_record import KV, PageRecord, join_page_records
from .tp_agreement import Agreement, agree_on_commit, commit_agreed

logger = logging.getLogger(__name__)

SWA = "swa"


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    lookup_tokens: int = 0        # prompt tokens looked up (the part a hit may cover)
    hit_tokens: int = 0           # tokens committed from the cache
    host_page_hits: int = 0       # pages served by the host tier
    file_page_hits: int = 0       # pages served by the file tier
    short_prefetches: int = 0     # lookups whose prefetch came back short of its plan
    released_pages: int = 0       # prefetched pages given back (short prefetch, agreement)
    inserted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass(frozen=True)
class PrefixHit:
    """What a request takes from the cache: its first plan.commit_tokens positions (copy holds
    them: every family's rows, SWA rows only of the window before the commit point, and the
    compressor state there), or nothing (copy None)."""
    plan: CommitPlan
    agreement: Agreement
    copy: KVHostCopy | None

    @property
    def tokens(self) -> int:
        return self.plan.commit_tokens


def _swa_whole(record: PageRecord) -> bool:
    mask = record.get(f"{KV}/{SWA}/mask")
    return mask is not None and bool(mask.all())


def _without_swa(record: PageRecord) -> PageRecord:
    """The record with no SWA rows (its SWA mask all False): a page before the window."""
    out = {}
    for name, t in record.items():
        parts = name.split("/")
        if parts[0] == KV and parts[1] == SWA:
            t = torch.zeros_like(t) if parts[-1] == "mask" else t[:0]
        out[name] = t
    return out


class PrefixCache:
    """Pages of `page_size` tokens for a model with an SWA window of `window` tokens.

    host_capacity_pages bounds the host tier; file_dir (optional) adds the file tier, bounded
    by file_capacity_pages (None: unbounded). namespace separates models that must never share
    pages (a model or checkpoint name). group: the tensor-parallel process group whose ranks
    agree on every commit (None: one rank, no collective)."""

    def __init__(self, page_size: int, window: int, host_capacity_pages: int,
                 file_dir: str | os.PathLike | None = None,
                 file_capacity_pages: int | None = None, namespace: str = "", group=None):
        for name, value in (("page_size", page_size), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.page_size = page_size
        self.window = window
        self.namespace = namespace
        self.group = group
        self.host = HostPageStore(host_capacity_pages)
        self.file = None if file_dir is None else FilePageStore(file_dir, file_capacity_pages)
        self.stats = PrefixCacheStats()

    def keys(self, token_ids: Sequence[int]) -> list[str]:
        return page_keys(token_ids, self.page_size, self.namespace)

    def contains(self, key: str) -> bool:
        return self.host.contains(key) or (self.file is not None and self.file.contains(key))

    # ---- insert -----------------------------------------------------------------------------

    def insert(self, key: str, record: PageRecord) -> bool:
        """Keep one page (a record with the ratio-4 compressor rings at its end, when the model
        has such layers). False when the page is already held or no tier could take it."""
        if self.contains(key):
            return False
        stored = self.host.put(key, record)
        if self.file is not None:
            try:
                self.file.put(key, record)
                stored = True
            except OSError as e:  # a full or failing disk costs the file tier, not the request
                logger.warning("prefix cache: page %s not written to %s: %s", key[:12],
                               self.file.directory, e)
        self.stats.inserted_pages += stored
        return stored

    # ---- admission ----------------------------------------------------------------------------

    def _fetch(self, key: str, pinned: list[str]) -> PageRecord | None:
        record = self.host.get(key)
        if record is not None:
            self.host.pin(key)
            pinned.append(key)
            self.stats.host_page_hits += 1
            return record
        record = None if self.file is None else self.file.get(key)
        if record is not None:
            self.stats.file_page_hits += 1
            if self.host.put(key, record):
                self.host.pin(key)
                pinned.append(key)
        return record

    def match(self, token_ids: Sequence[int], max_tokens: int | None = None,
              hit_pages_of_pools: Sequence[int] = ()) -> PrefixHit:
        """The cached prefix of token_ids[:max_tokens] every rank commits (collective when
        the cache has a group of several ranks: every rank must call it for the same prompt).
        hit_pages_of_pools: extra per-pool counts to agree on alongside (sidecar pools)."""
        ids = list(token_ids)[:max_tokens]
        keys = self.keys(ids)
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(ids)
        held = []
        for key in keys:
            if not self.contains(key):
                break
            held.append(key)
        plan = plan_prefix_commit([True] * len(held), [True] * len(held), self.page_size,
                                  self.window)
        pinned: list[str] = []
        try:
            records, full, swa = {}, set(), set()
            for page in plan.full_pages:
                record = self._fetch(keys[page], pinned)
                if record is None:
                    continue
                records[page] = record
                full.add(page)
                if _swa_whole(record):
                    swa.add(page)
            local, released = release_short_prefetch(plan, full, swa)
            if released or local.commit_tokens < plan.commit_tokens:
                self.stats.short_prefetches += 1
            held_from = local.swa_start_page     # the SWA run this rank holds up to its commit
            while held_from > 0 and held_from - 1 in swa:
                held_from -= 1
            agreement = agree_on_commit(local, [len(local.full_pages), len(local.swa_pages),
                                                *hit_pages_of_pools], self.group, held_from)
            commit, beyond = commit_agreed(local, agreement, held_from)
            self.stats.released_pages += (len(released.full_pages) + len(beyond.full_pages))
            self.stats.hit_tokens += commit.commit_tokens
            copy = self._join(commit, records) if commit.commit_tokens else None
        finally:
            for key in pinned:
                self.host.unpin(key)
        return PrefixHit(commit, agreement, copy)

    def _join(self, plan: CommitPlan, records: dict[int, PageRecord]) -> KVHostCopy:
        window = set(plan.swa_pages)
        return join_page_records([records[p] if p in window else _without_swa(records[p])
                                  for p in plan.full_pages])


def complete_states(pool, states: dict[str, dict[int, torch.Tensor]] | None
                    ) -> dict[str, dict[int, torch.Tensor]]:
    """Every state ring of the pool at a page boundary: the given ratio-4 rings (required: the
    next window pools with the one before the boundary) and a cleared ring (kv 0, score -inf)
    for each C128 layer."""
    states = states or {}
    ratio4 = set(pool.indexer_compressor_states)     # the ratio-4 layers
    out = {}
    for table, rings in (("compressor_state", pool.compressor_states),
                         ("indexer_compressor_state", pool.indexer_compressor_states)):
        out[table] = {}
        for layer, ring in rings.items():
            given = states.get(table, {}).get(layer)
            if given is None and layer in ratio4:
                raise ValueError(f"the cached prefix has no {table} ring for ratio-4 layer "
                                 f"{layer} at its end: it cannot be resumed there")
            if given is None:
                given = torch.zeros(ring.shape[1:], dtype=ring.dtype)
                given[:, ring.shape[-1] // 2:] = float("-inf")
            elif tuple(given.shape) != tuple(ring.shape[1:]):
                raise ValueError(f"{table} layer {layer}: a ring of shape {tuple(given.shape)}, "
                                 f"the pool's is {tuple(ring.shape[1:])}")
            out[table][layer] = given
    return out
