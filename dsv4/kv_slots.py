"""An engine's KV slots: its pool, the pool's allocator, the request -> token table, and what
each request holds in them.

``KVSlots.sized(spec, page_size, max_requests, max_context_len, device, ...)`` makes the pool and
its two-sided allocator (``mem_pool``, sized from a token count or a byte budget) and the request
-> token table (request slot 0 is the dummy that padded graph rows use; ``max_requests`` live
slots follow it). Its operations move a ``Request``'s hold: ``take`` gives requests fresh pages
from a page boundary and a slot each, their rows written in the table; ``extend`` gives a
request that holds a slot its next positions (a prompt's next chunk); ``grow`` gives every
running request its next location, which ``write_grown`` writes in the table from the step's
device inputs; ``release_out_of_window`` frees the SWA pages that left the window; ``release``
gives back pages and slot; ``host_copy``, ``host_rows`` and ``load_host_copy`` move a
request's KV to the host and back (retraction, the prefix cache). The request keeps its side on
the host: ``locs`` (its full location by position), ``slot`` and ``swa_freed_to`` (positions
before it have no SWA page), which these operations update.
"""

from __future__ import annotations

import torch

from mem_pool.dsv4_pool import create_dsv4_kv_cache
from mem_pool.host_copy import KVHostCopy
from mem_pool.kv_cache_spec import KVCacheSpec, footprint
from mem_pool.req_to_token_pool import ReqToTokenPool
from mem_pool.swa_window import pages_out_of_window

from .request import Request


def _check_counts(**counts) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def pool_sizes(spec: KVCacheSpec, page_size: int, max_requests: int, max_context_len: int,
               max_total_tokens: int | None = None, swa_tokens: int | None = None,
               kv_bytes: int | None = None) -> tuple[int, int]:
    """(full tokens, SWA tokens): given, from a byte budget, or enough for max_requests requests
    of max_context_len. A prefill chunk takes SWA slots for every token it computes (pages that
    leave the window are freed after the chunk), so by default the SWA side matches the full
    side."""
    if kv_bytes is not None:
        if max_total_tokens is not None:
            raise ValueError("pass max_total_tokens or kv_bytes, not both")
        fp = footprint(spec, page_size)
        if swa_tokens is None:
            spare = kv_bytes - fp.total_bytes(0, 0, max_requests + 1)
            swa_tokens = max(0, spare) // (fp.full_page_bytes + fp.swa_page_bytes) * page_size
        max_total_tokens = fp.max_total_tokens_for(kv_bytes, swa_tokens, max_requests + 1)
        if min(max_total_tokens, swa_tokens) < page_size:
            raise ValueError(f"kv_bytes={kv_bytes} holds less than one page "
                             f"(page_size={page_size}) on the full or the SWA side")
    elif max_total_tokens is None:
        max_total_tokens = max_requests * -(-max_context_len // page_size) * page_size
    return max_total_tokens, max_total_tokens if swa_tokens is None else swa_tokens


class KVSlots:
    """The pool (``pool``), its allocator (``allocator``) and the request -> token table
    (``req_to_token_pool``) of one engine, with its page size, window and device."""

    def __init__(self, spec: KVCacheSpec, max_total_tokens: int, swa_tokens: int, page_size: int,
                 max_requests: int, max_context_len: int, device):
        _check_counts(page_size=page_size, max_requests=max_requests,
                      max_context_len=max_context_len)
        self.page_size, self.window, self.device = page_size, spec.window_size, torch.device(device)
        self.pool, self.allocator = create_dsv4_kv_cache(
            spec, max_total_tokens, swa_tokens, page_size, self.device,
            max_num_reqs=max_requests + 1)
        self.req_to_token_pool = ReqToTokenPool(max_requests, max_context_len, self.device)

    @classmethod
    def sized(cls, spec: KVCacheSpec, page_size: int, max_requests: int, max_context_len: int,
              device, max_total_tokens: int | None = None, swa_tokens: int | None = None,
              kv_bytes: int | None = None) -> KVSlots:
        """Slots for a pool of max_total_tokens (or what kv_bytes buys; by default enough for
        max_requests requests of max_context_len), sized by ``pool_sizes``."""
        _check_counts(page_size=page_size, max_requests=max_requests,
                      max_context_len=max_context_len)
        full, swa = pool_sizes(spec, page_size, max_requests, max_context_len, max_total_tokens,
                               swa_tokens, kv_bytes)
        return cls(spec, full, swa, page_size, max_requests, max_context_len, device)

    # ---- sizes ------------------------------------------------------------------------------

    def pages(self, tokens: int) -> int:
        """The pages `tokens` positions from a page boundary take."""
        return -(-tokens // self.page_size)

    def free_pages(self) -> int:
        """Pages a new request could take now (a page on each side)."""
        a = self.allocator
        return min(a.full_available_size(), a.swa_available_size()) // self.page_size

    def capacity_pages(self) -> int:
        """The most pages one request could ever hold (the empty pool's free pages)."""
        return min(self.allocator.size_full, self.allocator.size_swa) // self.page_size

    def tokens_in_use(self) -> tuple[int, int]:
        """(full-side, SWA-side) token slots held now."""
        a = self.allocator
        return a.size_full - a.full_available_size(), a.size_swa - a.swa_available_size()

    # ---- a request's hold -------------------------------------------------------------------

    def take(self, reqs: list[Request], tokens: list[int]) -> torch.Tensor | None:
        """Fresh pages for tokens[i] positions of reqs[i], from a page boundary, and a request
        slot each, the slot's table row written: the device locations of all of them, in order.
        None, with nothing taken, when request slots or pages are short."""
        if not reqs or len(tokens) != len(reqs):
            raise ValueError(f"tokens must hold one count per request of reqs (a non-empty "
                             f"list): got {len(tokens)} for {len(reqs)}")
        for i, (req, n) in enumerate(zip(reqs, tokens)):
            _check_counts(**{f"tokens[{i}]": n})
            if n > self.req_to_token_pool.max_context_len:
                raise ValueError(f"tokens[{i}]={n} exceeds max_context_len="
                                 f"{self.req_to_token_pool.max_context_len}")
            if req.slot is not None:
                raise ValueError(f"reqs[{i}] (request {req.index}) already holds slot {req.slot}")
        if len(reqs) > self.req_to_token_pool.available():
            return None
        lens = torch.tensor(tokens)
        locs = self.allocator.alloc_extend(torch.zeros_like(lens), lens, torch.full_like(lens, -1),
                                           int(lens.sum()))
        if locs is None:
            return None
        host, start = self.allocator.last_handed_out.tolist(), 0
        for req, n in zip(reqs, tokens):
            req.slot = self.req_to_token_pool.alloc()
            self.req_to_token_pool.write(req.slot, 0, locs[start:start + n])
            req.locs, req.swa_freed_to = host[start:start + n], 0
            start += n
        return locs

    def extend(self, reqs: list[Request], tokens: list[int]) -> torch.Tensor | None:
        """tokens[i] more positions for reqs[i], which holds a slot, after the len(locs) it
        holds (a prompt's next chunk), written in its table row and appended to its locs: the
        device locations, request by request. None, with nothing taken, when the pool is short."""
        if not reqs or len(tokens) != len(reqs):
            raise ValueError(f"tokens must hold one count per request of reqs (a non-empty "
                             f"list): got {len(tokens)} for {len(reqs)}")
        held = []
        for i, (req, n) in enumerate(zip(reqs, tokens)):
            self._slot("reqs", i, req)
            _check_counts(**{f"tokens[{i}]": n})
            held.append(len(req.locs))
            if held[-1] + n > self.req_to_token_pool.max_context_len:
                raise ValueError(f"tokens[{i}]={n} after the {held[-1]} positions request "
                                 f"{req.index} holds exceeds max_context_len="
                                 f"{self.req_to_token_pool.max_context_len}")
        prefix, lens = torch.tensor(held), torch.tensor(tokens)
        last = torch.tensor([r.locs[-1] if r.locs else -1 for r in reqs])
        locs = self.allocator.alloc_extend(prefix, prefix + lens, last, int(lens.sum()))
        if locs is None:
            return None
        host, start = self.allocator.last_handed_out.tolist(), 0
        for req, p, n in zip(reqs, held, tokens):
            self.req_to_token_pool.write(req.slot, p, locs[start:start + n])
            req.locs.extend(host[start:start + n])
            start += n
        return locs

    def clear_state(self, reqs: list[Request]) -> None:
        """Reset the compressor state rings of the requests' slots (a prompt starts from none)."""
        self.pool.clear_compressor_state(
            torch.tensor([self._slot("reqs", i, r) for i, r in enumerate(reqs)],
                         device=self.device))

    def grow(self, running: list[Request]) -> list[int] | None:
        """One more location for every running request (position seq_len), appended to its
        locs, seq_len counting it: the host locations, which the caller copies to the device
        with the step's other inputs and writes in the table (``write_grown``). None, with
        nothing taken, when the pool is short."""
        if not running:
            raise ValueError("running must hold at least one request")
        for i, req in enumerate(running):
            self._slot("running", i, req)
        locs = self.allocator.alloc_decode([r.seq_len + 1 for r in running],
                                           [r.locs[-1] for r in running], to_device=False)
        if locs is None:
            return None
        for req, loc in zip(running, locs):
            req.locs.append(loc)
            req.seq_len += 1
        return locs

    def write_grown(self, slots: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor,
                    highest: int) -> None:
        """The table entries of a ``grow``: req_to_token[slots[i], positions[i]] = locs[i], in
        one indexed write, from device tensors (highest: the largest position, a host int)."""
        self.req_to_token_pool.write_positions(slots, positions, locs, highest)

    def release_out_of_window(self, req: Request, tokens: int) -> None:
        """Free the SWA pages of the whole pages that left the window once the request holds
        `tokens` positions (only those not freed before: nothing on most steps; never a rescan
        of the request's history)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not (
                0 <= tokens <= len(req.locs)):
            raise ValueError(f"tokens must be an int in 0..{len(req.locs)} (the positions "
                             f"request {req.index} holds), got {tokens!r}")
        gone = pages_out_of_window(tokens, self.window, self.page_size) * self.page_size
        if gone > req.swa_freed_to:
            self.allocator.free_swa(torch.tensor(req.locs[req.swa_freed_to:gone]))
            req.swa_freed_to = gone

    def release(self, req: Request) -> None:
        """Free the request's pages and its slot."""
        slot = self._slot("req", None, req)
        self.allocator.free(torch.tensor(req.locs, dtype=torch.int64))
        self.req_to_token_pool.free(slot)
        req.slot, req.locs = None, []

    # ---- host copies ------------------------------------------------------------------------

    def host_copy(self, req: Request) -> KVHostCopy:
        """The request's KV rows of every position it holds and its slot's compressor state
        rings, on the host (what a retraction keeps)."""
        slot = self._slot("req", None, req)
        locs = torch.tensor(req.locs, dtype=torch.int64, device=self.device)
        return self.pool.get_cpu_copy(locs, req_pool_idx=slot)

    def host_rows(self, req: Request, start: int, end: int) -> KVHostCopy:
        """The request's KV rows of positions start..end-1 on the host, without state rings."""
        if not 0 <= start < end <= len(req.locs):
            raise ValueError(f"start={start}, end={end}: expected 0 <= start < end <= "
                             f"{len(req.locs)} (the positions request {req.index} holds)")
        return self.pool.get_cpu_copy(torch.tensor(req.locs[start:end], device=self.device))

    def load_host_copy(self, req: Request, copy: KVHostCopy) -> None:
        """Write a host copy (rows and state rings) at the request's first copy.num_tokens
        positions and into its slot."""
        slot = self._slot("req", None, req)
        if copy.num_tokens > len(req.locs):
            raise ValueError(f"copy holds {copy.num_tokens} positions; request {req.index} "
                             f"holds {len(req.locs)}")
        locs = torch.tensor(req.locs[:copy.num_tokens], dtype=torch.int64, device=self.device)
        self.pool.load_cpu_copy(copy, locs, req_pool_idx=slot)

    @staticmethod
    def _slot(name: str, i: int | None, req: Request) -> int:
        if req.slot is None:
            where = name if i is None else f"{name}[{i}]"
            raise ValueError(f"{where} (request {req.index}) holds no request slot")
        return req.slot
