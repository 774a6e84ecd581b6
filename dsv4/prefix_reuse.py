"""The engine's side of the prefix cache (``mem_pool.prefix``).

On admission each prompt asks the cache for its longest cached prefix, leaving at least its
last token to compute (the first generated token needs its logits). The request gets fresh
pages for the whole prompt as usual; the cached positions are written into them from the host
copy (SWA pages before the window are freed first, so the copy's SWA rows and the request's
slots line up, as after a retraction), and the prefill extends only the rest.

After each prefill chunk every whole prompt page it completed that the cache lacks is inserted
(before the chunk's SWA pages that left the window are freed): its rows copied from the device,
and the ratio-4 compressor rings at the page's end taken from the forward itself (the batch asks
for the (kv, score) rows of the ``ring`` positions before each page end, which is exactly what a
ring holds there; pages are multiples of the ring, so position p sits at ring row p % ring in
order, and chunks start on a multiple of the ring, so one chunk computes all of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mem_pool import envs as _pool_envs  # noqa: F401  (registers the pool's flags first)
from mem_pool.host_copy import KVHostCopy
from mem_pool.kv_cache_spec import STATE_RING
from mem_pool.prefix import (PrefixCache, PrefixHit, complete_states, split_host_copy,
                             with_boundary_state)

from .kv_slots import KVSlots
from .options import Options
from .request import Request

RING = STATE_RING[4]


def prefix_cache_from_options(options: Options, page_size: int, window: int,
                              device_pages: int, group=None) -> PrefixCache | None:
    """The cache options.prefix_cache asks for (DSV4_PREFIX_CACHE; None when it is off).
    group: the tensor-parallel ranks' process group, which agrees on every prefix commit."""
    if not options.prefix_cache:
        return None
    host_pages = options.prefix_cache_host_pages
    if host_pages < 0:
        raise ValueError(f"DSV4_PREFIX_CACHE_HOST_PAGES={host_pages}: expected >= 0")
    return PrefixCache(page_size, window, host_pages or device_pages,
                       file_dir=options.prefix_cache_dir or None, group=group)


def match_prompt(cache: PrefixCache, req: Request) -> PrefixHit:
    return cache.match(req.prompt, max_tokens=len(req.prompt) - 1)


def load_prefix(slots: KVSlots, req: Request, hit: PrefixHit) -> None:
    """Write the hit's positions into the request's fresh pages and its slot's compressor
    rings; free the SWA pages before the window."""
    slots.release_out_of_window(req, hit.tokens)
    copy = hit.copy
    slots.load_host_copy(req, KVHostCopy(copy.num_tokens, copy.families,
                                         complete_states(slots.pool, copy.states)))


@dataclass
class BoundaryCapture:
    """Which captured rows belong to which page end: (request, page index, first row)."""
    rows: torch.Tensor
    ends: list[tuple[Request, int, int]]


def boundary_capture(reqs: list[Request], starts: list[int], stops: list[int], page_size: int,
                     device) -> BoundaryCapture:
    """The batch rows whose ring rows an extend over positions starts[i]..stops[i]-1 of reqs[i]
    must hand back: for every page end b it covers, the RING positions before b (all in this
    extend: its start is a multiple of RING, the engine's chunks see to it)."""
    rows, ends, offset = [], [], 0
    for req, start, stop in zip(reqs, starts, stops):
        if start % RING:
            raise ValueError(f"starts: request {req.index}'s extend starts at {start}, not a "
                             f"multiple of the ring ({RING})")
        first = (start // page_size + 1) * page_size
        for end in range(first, stop + 1, page_size):
            ends.append((req, end // page_size - 1, len(rows)))
            rows.extend(range(offset + end - RING - start, offset + end - start))
        offset += stop - start
    return BoundaryCapture(torch.tensor(rows, dtype=torch.int64, device=device), ends)


def insert_prompt_pages(slots: KVSlots, cache: PrefixCache, capture: BoundaryCapture,
                        captured: dict[str, dict[int, torch.Tensor]] | None) -> None:
    """Insert the whole prompt pages this prefill chunk completed that the cache does not
    hold."""
    by_req: dict[int, list[tuple[int, int]]] = {}
    for req, page, row in capture.ends:
        by_req.setdefault(id(req), []).append((page, row))
    reqs = {id(req): req for req, _, _ in capture.ends}
    for key_id, ends in by_req.items():
        req = reqs[key_id]
        keys = cache.keys(req.prompt)
        todo = [(page, row) for page, row in ends if not cache.contains(keys[page])]
        if not todo:
            continue
        first, last = todo[0][0], todo[-1][0]
        P = slots.page_size
        records = split_host_copy(slots.host_rows(req, first * P, (last + 1) * P), P)
        for page, row in todo:
            states = {table: {layer: rows[row:row + RING].cpu()
                              for layer, rows in layers.items()}
                      for table, layers in (captured or {}).items()}
            cache.insert(keys[page], with_boundary_state(records[page - first], states))
