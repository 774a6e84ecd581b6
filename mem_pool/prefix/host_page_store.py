"""The host-memory tier of the prefix KV cache: page records by page key, least recently used
out first.

A store holds at most `capacity_pages` records. Putting a new page into a full store evicts the
least recently used page that is not pinned; when every page is pinned the put is refused
(returns False) and nothing changes. A pin (counted: pin twice, unpin twice) marks a page that
is being loaded, so it stays until unpinned. `get` counts as a use; `contains` does not.
`on_evict(key, record)`, when given, is told of each page a put pushes out (to demote it to a
lower tier, for instance). Records are held as given, not copied. Not thread-safe.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

from .page_record import PageRecord

logger = logging.getLogger(__name__)


class HostPageStore:
    def __init__(self, capacity_pages: int,
                 on_evict: Callable[[str, PageRecord], None] | None = None):
        if isinstance(capacity_pages, bool) or not isinstance(capacity_pages, int) or (
                capacity_pages < 1):
            raise ValueError(f"capacity_pages must be a positive int, got {capacity_pages!r}")
        self.capacity_pages = capacity_pages
        self._on_evict = on_evict
        self._records: OrderedDict[str, PageRecord] = OrderedDict()  # oldest use first
        self._pins: dict[str, int] = {}

    # ---- sizes ----------------------------------------------------------------------------

    def used_pages(self) -> int:
        return len(self._records)

    def free_pages(self) -> int:
        return self.capacity_pages - len(self._records)

    def pinned_pages(self) -> int:
        return len(self._pins)

    def keys(self) -> list[str]:
        """Held keys, least recently used first."""
        return list(self._records)

    # ---- pages ----------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        return key in self._records

    def get(self, key: str) -> PageRecord | None:
        record = self._records.get(key)
        if record is not None:
            self._records.move_to_end(key)
        return record

    def put(self, key: str, record: PageRecord) -> bool:
        """Store (or replace) a page; False when the store is full of pinned pages."""
        if key not in self._records and not self._make_room():
            logger.debug("host page store full of pinned pages: page %s not stored", key)
            return False
        self._records[key] = record
        self._records.move_to_end(key)
        return True

    def _make_room(self) -> bool:
        if len(self._records) < self.capacity_pages:
            return True
        victim = next((k for k in self._records if k not in self._pins), None)
        if victim is None:
            return False
        record = self._records.pop(victim)
        if self._on_evict is not None:
            self._on_evict(victim, record)
        return True

    def evict(self, key: str) -> bool:
        """Drop a page (False when absent). A pinned page cannot be dropped."""
        if key in self._pins:
            raise ValueError(f"page {key} is pinned (being loaded): unpin it before evicting")
        return self._records.pop(key, None) is not None

    # ---- pins -----------------------------------------------------------------------------

    def pin(self, key: str) -> None:
        if key not in self._records:
            raise KeyError(f"page {key} is not in the host page store")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        count = self._pins.get(key, 0)
        if count == 0:
            raise ValueError(f"page {key} is not pinned")
        if count == 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1
