"""Where each request of one ``Engine.generate`` call is, and the decisions that move it: a
request waits for admission, prefills (holding a slot and the pages of the chunks done), runs
(decodes) or sits retracted on the host. ``Scheduler`` admits prompts while slots, pages and
the step's token budget last, hands out the next chunks of the prefilling prompts, and, when the
pool runs short, sends the latest prefilling prompt back to the queue or retracts the latest
running request (``retraction.py``), resuming it when pages free up. The engine runs the steps.
"""

from __future__ import annotations

from collections import deque

import torch

from .kv_slots import KVSlots
from .prefix_reuse import RING, load_prefix, match_prompt
from .request import Request
from .retraction import retract, try_resume


class Scheduler:
    """The queues of one generate call over an engine's ``KVSlots`` (``slots``), its prefix
    cache (or None), its request slots (``max_batch``) and its counters (``stats``)."""

    def __init__(self, slots: KVSlots, prefix_cache, max_batch: int, stats,
                 waiting: list[Request]):
        self.slots, self.prefix_cache, self.max_batch, self.stats = (slots, prefix_cache,
                                                                     max_batch, stats)
        self.waiting: deque[Request] = deque(waiting)
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.retracted: deque[Request] = deque()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.retracted or self.running or self.prefilling)

    def resume(self) -> None:
        """Resume retracted requests first (oldest first, keeping a page of headroom per running
        request so they do not bounce straight back, and the pages the prefilling prompts
        still have to take)."""
        slots = self.slots
        while self.retracted and len(self.running) + len(self.prefilling) < self.max_batch and (
                not (self.running or self.prefilling) or slots.pages(self.retracted[0].seq_len)
                + len(self.running) + self.reserved() <= slots.free_pages()) and try_resume(
                    slots, self.retracted[0]):
            self.running.append(self.retracted.popleft())
            self.stats.resumptions += 1

    def reserved(self) -> int:
        """Pages the prefilling prompts have still to take for their later chunks."""
        slots = self.slots
        return sum(slots.pages(len(r.prompt)) - slots.pages(len(r.locs)) for r in self.prefilling)

    def piece(self, start: int, prompt_len: int, budget: int) -> int:
        """The tokens of a prompt's next chunk from `start` within `budget` (0: none fits). A
        chunk that does not end the prompt ends on a multiple of RING (8): the prefix cache
        keeps its rings at such positions, and a step's rows come in multiples of 8 whatever
        the decodes took of its budget (torch's CPU kernels round some rows of a tensor by
        where they fall in its vector blocks: see docs/numerics.md)."""
        end = min(prompt_len, start + budget)
        if end < prompt_len:
            end -= end % RING
        return max(0, end - start)

    def admit(self, budget: int) -> list[tuple[Request, int, torch.Tensor]]:
        """Admit waiting prompts (oldest first) while request slots, pages (for the whole
        prompt, beyond what the prefilling ones still take) and budget last: their first chunks
        as (request, chunk start, device locations)."""
        slots, cache, pieces = self.slots, self.prefix_cache, []
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
            req = self.waiting[0]
            if (slots.pages(len(req.prompt)) + self.reserved() > slots.free_pages()
                    or budget < (RING if cache else 1)):
                break
            hit = match_prompt(cache, req) if cache else None
            k = hit.tokens if hit else 0
            n = self.piece(k, len(req.prompt), budget)
            if n == 0:
                break
            locs = slots.take([req], [k + n])
            if locs is None:
                break
            self.waiting.popleft()
            slots.clear_state([req])
            req.seq_len = k
            if k:
                load_prefix(slots, req, hit)
            self.stats.prompt_tokens += len(req.prompt)
            self.stats.prefix_hit_tokens += k
            self.prefilling.append(req)
            pieces.append((req, k, locs[k:]))
            budget -= n
        return pieces

    def requeue(self) -> None:
        """Send the latest admitted prefilling prompt back to the front of the queue."""
        req = self.prefilling.pop()
        self.slots.release(req)
        req.seq_len = 0
        self.waiting.appendleft(req)
        self.stats.requeued += 1

    def next_chunks(self, budget: int) -> list[tuple[Request, int, torch.Tensor]]:
        """The next chunks of the prefilling prompts (oldest first) within budget, their pages
        taken; when the pool is short, the latest prefilling prompt is requeued, else the latest
        running request retracted."""
        pieces = []
        i = 0
        while i < len(self.prefilling) and budget:
            req = self.prefilling[i]
            n = self.piece(req.seq_len, len(req.prompt), budget)
            if n == 0:
                break
            locs = self.slots.extend([req], [n])
            if locs is not None:
                pieces.append((req, req.seq_len, locs))
                budget -= n
                i += 1
            elif len(self.prefilling) > i + 1:
                self.requeue()
            elif self.running:
                self.retract()
            else:   # admission checked its pages: only a smaller pool than it saw gets here
                raise RuntimeError(f"KV pool exhausted: the next chunk of request {req.index} "
                                   f"({n} tokens) does not fit")
        return pieces

    def retract(self) -> None:
        victim = self.running.pop()
        retract(self.slots, victim)
        self.retracted.appendleft(victim)
        self.stats.retractions += 1

    def fail_stuck(self) -> None:
        slots = self.slots
        stuck = self.retracted.popleft() if self.retracted else self.waiting.popleft()
        stuck.fail(f"KV pool exhausted: request {stuck.index} needs "
                   f"{slots.pages(max(stuck.seq_len, len(stuck.prompt)))} pages of "
                   f"{slots.page_size} tokens and the empty pool has {slots.free_pages()}")
