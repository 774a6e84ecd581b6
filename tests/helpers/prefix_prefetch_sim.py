"""One rank's prefix prefetch, simulated on the real building blocks: the prefix's pages in a
HostPageStore and a FilePageStore, device pages from PagedAllocators, the SWA plan, the short
prefetch replan, the TP agreement and the final commit / release.

Full-side pages (compressed rows) 0..host_pages-1 are offered to the host tier, last page
first (so that LRU eviction drops a prefix's tail before its head), the rest sit in the file
tier; SWA-side pages sit in the file tier under `<key>-swa`. A rank's outcome is shaped by:
- host_room: how many of the prefix's pages fit in its host tier (the tier also holds another
  request's pinned pages; putting more evicts the prefix's own later pages: fewer hits);
- corrupt: (side, page) files damaged after writing (the load finds a miss);
- arrive: how many pages of the plan the load finishes before its deadline (slow rank).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mem_pool import (FilePageStore, HostPageStore, PagedAllocator, agree_on_commit,
                      commit_agreed, page_keys, plan_prefix_commit, release_short_prefetch)

PAGE_SIZE, WINDOW = 4, 10
SIDES = ("full", "swa")


def page_record(side: str, page: int) -> dict[str, torch.Tensor]:
    """The bytes a page holds, different per side and page."""
    g = torch.Generator().manual_seed(17 * page + (1 if side == "swa" else 0))
    family, rows = ("swa", PAGE_SIZE) if side == "swa" else ("c4", PAGE_SIZE // 4)
    return {f"kv/{family}/mask": torch.ones(PAGE_SIZE, dtype=torch.bool) if side == "swa"
            else torch.arange(PAGE_SIZE) % 4 == 3,
            f"kv/{family}/0/values": torch.randint(0, 256, (rows, 16), generator=g,
                                                   dtype=torch.uint8),
            f"kv/{family}/0/scales": torch.randint(0, 256, (rows, 4), generator=g,
                                                   dtype=torch.uint8)}


def same_record(a, b) -> bool:
    return a is not None and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


class RankPrefix:
    def __init__(self, directory: Path, num_pages: int, host_pages: int, host_room: int,
                 corrupt: list[tuple[str, int]] = ()):
        tokens = [1000 + t for t in range(num_pages * PAGE_SIZE)]
        self.keys = {"full": page_keys(tokens, PAGE_SIZE)}
        self.keys["swa"] = [k + "-swa" for k in self.keys["full"]]
        self.num_pages = num_pages
        self.host = HostPageStore(host_room + 2)
        for i in range(2):                                  # another request's pages, pinned
            self.host.put(f"other{i}", page_record("full", 99))
            self.host.pin(f"other{i}")
        self.files = FilePageStore(directory)
        for page in reversed(range(min(host_pages, num_pages))):
            assert self.host.put(self.keys["full"][page], page_record("full", page))
        for page in range(host_pages, num_pages):
            self.files.put(self.keys["full"][page], page_record("full", page))
        for page in range(num_pages):
            self.files.put(self.keys["swa"][page], page_record("swa", page))
        for side, page in corrupt:
            path = self.files.path_of(self.keys[side][page])
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        size = (num_pages + 1) * PAGE_SIZE
        self.device = {side: PagedAllocator(size, PAGE_SIZE) for side in SIDES}
        self.device_free_at_start = {s: a.available_pages() for s, a in self.device.items()}
        self.device_pages: dict[tuple[str, int], int] = {}   # (side, prefix page) -> page
        self.device_bytes: dict[tuple[str, int], dict] = {}   # (side, device page) -> record

    def cached(self, side: str, page: int) -> bool:
        key = self.keys[side][page]
        return self.host.contains(key) or self.files.contains(key)

    def hits(self) -> list[int]:
        """Per side, how many of the prefix's pages a lookup finds."""
        return [sum(self.cached(s, p) for p in range(self.num_pages)) for s in SIDES]

    def prefetch(self, arrive: int):
        """Plan on what the tiers hold, load (the first `arrive` pages in prefix order before
        the deadline), plan again on what arrived; returns (plan, local plan, arrived)."""
        plan = plan_prefix_commit([self.cached("full", p) for p in range(self.num_pages)],
                                  [self.cached("swa", p) for p in range(self.num_pages)],
                                  PAGE_SIZE, WINDOW)
        planned = {"full": plan.full_pages, "swa": plan.swa_pages}
        pinned = [self.keys["full"][p] for p in plan.full_pages
                  if self.host.contains(self.keys["full"][p])]
        for key in pinned:
            self.host.pin(key)
        arrived = {s: set() for s in SIDES}
        for side in SIDES:
            taken = self.device[side].alloc_pages(len(planned[side])).tolist()
            for page, device_page in zip(planned[side], taken):
                self.device_pages[side, page] = device_page
                if page >= arrive:
                    continue
                key = self.keys[side][page]
                record = self.host.get(key) if self.host.contains(key) else self.files.get(key)
                if record is not None:
                    self.device_bytes[side, device_page] = record
                    arrived[side].add(page)
        for key in pinned:
            self.host.unpin(key)
        local, release = release_short_prefetch(plan, arrived["full"], arrived["swa"])
        for side in SIDES:    # pages that never arrived hold nothing: their device pages go too
            self.release(side, [p for p in planned[side] if p not in arrived[side]])
        self.release("full", release.full_pages)
        self.release("swa", release.swa_pages)
        return plan, local, arrived

    def release(self, side: str, pages) -> None:
        for page in pages:
            device_page = self.device_pages.pop((side, page))
            self.device_bytes.pop((side, device_page), None)
            self.device[side].free_pages(torch.tensor([device_page]))

    def run(self, arrive: int, group) -> dict:
        """The whole flow; returns what the test checks, as plain data."""
        hits = self.hits()
        plan, local, arrived = self.prefetch(arrive)
        agreed = agree_on_commit(local, hits, group)
        commit, surplus = commit_agreed(local, agreed)
        self.release("full", surplus.full_pages)
        self.release("swa", surplus.swa_pages)
        held = sorted(self.device_pages)
        intact = all(same_record(self.device_bytes.get((key[0], self.device_pages[key])),
                                 page_record(*key)) for key in held)
        free_after_commit = {s: a.available_pages() for s, a in self.device.items()}
        for side, page in held:                               # the request finishes
            self.release(side, [page])
        return {"hits": hits, "planned_tokens": plan.commit_tokens,
                "arrived": {s: sorted(v) for s, v in arrived.items()},
                "local_tokens": local.commit_tokens,
                "local_swa": list(local.swa_pages), "local_full": list(local.full_pages),
                "agreed_tokens": agreed.commit_tokens, "agreed_hits": list(agreed.hit_pages),
                "commit_full": list(commit.full_pages), "commit_swa": list(commit.swa_pages),
                "surplus_full": list(surplus.full_pages),
                "surplus_swa": list(surplus.swa_pages),
                "held": [list(k) for k in held], "intact": intact,
                "free_at_start": self.device_free_at_start,
                "free_after_commit": free_after_commit,
                "free_at_end": {s: a.available_pages() for s, a in self.device.items()},
                "host_pinned_at_end": self.host.pinned_pages(),
                "host_used_at_end": self.host.used_pages()}
