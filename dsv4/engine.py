"""A small batch-synchronous engine: admit prompts into the paged pools, prefill, then decode.

``Engine(model, max_total_tokens=... | kv_bytes=...)`` owns its KV slots (``kv_slots.py``: the
pool and allocator of ``mem_pool``, sized from a token count or a byte budget, and the request ->
token table), which every request's pages and slot come from and go back to.
``generate`` admits the prompts that fit (request slots and pages), prefills them in one extend
step, then decodes all running requests together, one token per step (greedy, sampled as
``sampling`` says, or the ``forced_tokens`` given). A request stops at max_new_tokens or
``eos_token_id``; its pages are freed at once and it leaves the batch. When a decode step finds
the pool exhausted, the latest admitted request is retracted to the host (``retraction.py``)
and resumed when pages free up. SWA pages that leave the window are released after every step. Decode steps replay captured
graphs (``graphs/decode_runner.py``) when ``options.graph`` (DSV4_GRAPH) is on. With a prefix
cache (``prefix_cache=`` or DSV4_PREFIX_CACHE) a prompt's cached prefix is loaded instead of
prefilled (``prefix_reuse.py``).

Flags are read once, when the engine is made: ``Engine(model, options=None)`` takes
``Options.from_env()`` then, and hands that value to every forward, to its graphs and to its
prefix cache; a flag changed afterwards changes nothing in this engine (pass ``options=`` or make
another engine).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from hip_kernels.checks import trusted_locations
from mem_pool.kv_cache_spec import KVCacheSpec

from .forward_batch import ForwardBatch, ForwardMode
from .graphs.decode_runner import decode_inputs, make_decode_graph_runner
from .kv_slots import KVSlots
from .options import Options
from .paged_attention import RingRowCapture
from .prefix_reuse import (boundary_capture, insert_prompt_pages, load_prefix, match_prompt,
                           prefix_cache_from_options)
from .request import Request
from .request_checks import check_call, request_error
from .retraction import retract, try_resume
from .sampling import GREEDY, SamplingParams, sample

logger = logging.getLogger(__name__)

PAGE_SIZE = 256   # tokens per KV page unless the caller says otherwise


@dataclass
class GenerateOutput:
    tokens: list[list[int]]              # the tokens appended to each request (sampled or forced)
    logits: torch.Tensor | None = None   # fp32 [batch, steps, vocab]; step 0 follows the prompt;
                                         # NaN after a request's end token (and for a failed one)
    errors: list[str | None] = field(default_factory=list)  # why a request failed, else None


@dataclass
class EngineStats:
    decode_step_s: list[float] = field(default_factory=list)  # wall time of each decode step
    decode_tokens: int = 0               # tokens appended by decode steps
    first_token_s: float | None = None   # from generate() to the end of its first prefill
    graph_steps: int = 0                 # decode steps that replayed a graph
    eager_swa_translations: int = 0      # SWA gathers run by eager decode steps
    eager_swa_hits: int = 0              # SWA location cache hits of eager decode steps
    retractions: int = 0
    resumptions: int = 0
    peak_full_tokens: int = 0            # most full-pool token slots in use at once
    peak_swa_tokens: int = 0
    prefill_s: list[float] = field(default_factory=list)  # wall time of each prefill step
    prompt_tokens: int = 0               # prompt tokens admitted
    prefix_hit_tokens: int = 0           # of those, loaded from the prefix cache

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def eager_steps(self) -> int:
        return len(self.decode_step_s) - self.graph_steps


class Engine:
    """Decode engine for one ``DeepseekV4Model``: its KV pool, its request slots, its graphs.

    The pool holds ``max_total_tokens`` tokens (or what ``kv_bytes`` buys); by default enough
    for ``max_batch`` requests of ``max_context_len`` tokens (the model's ``max_seq_len``).
    ``generate(prompts, max_new_tokens, sampling=SamplingParams(...))`` returns a
    ``GenerateOutput``: the new tokens of each prompt and, per request, ``errors``.
    ``graph`` (default: DSV4_GRAPH) captures decode steps as graphs; ``eos_token_id`` ends a
    request early. On a CPU, set ``torch.set_num_threads(1)`` first, as ``python -m dsv4
    generate`` does: the tiny model's ops are too small to share between threads, and on a busy
    machine torch's default thread count makes the same call several times slower.

    Tensor parallel (a model of a ``dsv4.parallel`` split): every rank runs its own Engine on the
    same prompts. Admission, retraction and prefix-cache decisions depend only on the prompts,
    the pool (the same size on every rank: each keeps the whole KV) and the logits, which the
    head's all_gather makes the same bits on every rank, so the ranks decide alike and meet at
    every collective; the prefix cache's commits are agreed over the split's group.
    """

    def __init__(self, model, max_total_tokens: int | None = None, swa_tokens: int | None = None,
                 page_size: int = PAGE_SIZE, max_batch: int = 8, max_context_len: int | None = None,
                 kv_bytes: int | None = None, eos_token_id: int | None = None,
                 graph: bool | None = None, prefix_cache=None, options: Options | None = None):
        """prefix_cache: a ``mem_pool.prefix.PrefixCache`` of this page size and window,
        False for none, or None to follow options.prefix_cache (off by default). graph: capture
        and replay decode steps; None follows options.graph. options: what every step computes
        with (a ``dsv4.Options``); None reads the DSV4_* flags now, once."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        cfg = model.config
        self.options = Options.from_env() if options is None else options
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.eos_token_id = eos_token_id
        self.max_context_len = max_context_len or model.max_seq_len
        if self.max_context_len > model.max_seq_len:
            raise ValueError(f"max_context_len={self.max_context_len} exceeds the model's RoPE "
                             f"tables (max_seq_len={model.max_seq_len})")
        spec = KVCacheSpec(compress_ratios=cfg.compress_ratios[:cfg.n_layers],
                           window_size=cfg.window_size)
        self.slots = KVSlots.sized(spec, page_size, max_batch, self.max_context_len, self.device,
                                   max_total_tokens, swa_tokens, kv_bytes)
        self.stats = EngineStats()
        use_graph = self.options.graph if graph is None else graph
        # Tensor parallel on a GPU captures the collectives in the step (NCCL/RCCL); the CPU
        # emulation's graphs cannot hold gloo's, so there the ranks run eagerly.
        self.eager_reason = ("tensor parallel on a CPU runs eagerly"
                             if use_graph and model.split.size > 1 and self.device.type == "cpu"
                             else None)
        use_graph = use_graph and self.eager_reason is None
        self.graph_runner = make_decode_graph_runner(
            model, self.pool, self.req_to_token, max_batch, self.max_context_len,
            self.device, self.options) if use_graph else None
        if prefix_cache is None:
            prefix_cache = prefix_cache_from_options(self.options, page_size, cfg.window_size,
                                                     self.allocator.size_full // page_size,
                                                     model.split.group)
        elif prefix_cache is not False and (prefix_cache.page_size, prefix_cache.window) != (
                page_size, cfg.window_size):
            raise ValueError(f"prefix_cache holds pages of {prefix_cache.page_size} tokens for "
                             f"a window of {prefix_cache.window}; this engine has page_size="
                             f"{page_size} and window {cfg.window_size}")
        self.prefix_cache = prefix_cache or None

    # The slots' parts, for callers that look into the KV memory (tests, scripts, the report).
    pool = property(lambda self: self.slots.pool)
    allocator = property(lambda self: self.slots.allocator)
    req_to_token_pool = property(lambda self: self.slots.req_to_token_pool)
    req_to_token = property(lambda self: self.slots.req_to_token_pool.req_to_token)

    def forward(self, batch: ForwardBatch, all_logits: bool = False,
                ring_capture: RingRowCapture | None = None) -> torch.Tensor:
        """The model on a batch this engine built, with this engine's options: its locations
        come from the allocator, which checked them when it handed them out, so the forward
        skips the per-op range checks."""
        with trusted_locations():
            return self.model(batch, self.pool, self.req_to_token, all_logits=all_logits,
                              options=self.options, ring_capture=ring_capture)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], max_new_tokens: int,
                 return_logits: bool = False,
                 forced_tokens: list[list[int]] | None = None,
                 on_step: Callable[[], None] | None = None,
                 sampling: SamplingParams = GREEDY) -> GenerateOutput:
        """on_step: called after every decode step (progress reporting).

        A request that is malformed (token ids that are not ints of the vocabulary), too long for
        max_context_len, or too large for the whole pool fails on its own: its `errors` entry
        says why, its tokens are empty or stop where it failed, and the other requests complete
        as they would have without it. Mistakes of the call itself raise ValueError."""
        vocab, slots = self.model.config.vocab_size, self.slots
        check_call(prompt_token_ids, max_new_tokens, forced_tokens, vocab)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a dsv4.SamplingParams, got "
                            f"{type(sampling).__name__}")
        reqs = [Request(i, list(p), max_new_tokens, forced_tokens[i] if forced_tokens else None,
                        error=request_error(i, p, max_new_tokens, vocab, self.max_context_len,
                                            slots.page_size, slots.capacity_pages()))
                for i, p in enumerate(prompt_token_ids)]
        self._sampling = sampling
        self._generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
        self._started = time.perf_counter()
        waiting, retracted, running = deque(r for r in reqs if r.error is None), deque(), []
        try:
            while waiting or retracted or running:
                self._schedule(waiting, retracted, running, return_logits)
                if running:
                    self._decode_step(running, retracted, return_logits)
                    if on_step is not None:
                        on_step()
        finally:
            for req in running:
                slots.release(req)
        logits = _stack_logits([r.logits for r in reqs]) if return_logits else None
        return GenerateOutput([r.out for r in reqs], logits, [r.error for r in reqs])

    # ---- admission --------------------------------------------------------------------------

    def _schedule(self, waiting, retracted, running, return_logits) -> None:
        """Resume retracted requests first (oldest first, keeping a page of headroom per running
        request so they do not bounce straight back), then prefill the prompts that fit."""
        slots = self.slots
        while retracted and len(running) < self.max_batch and (
                not running or slots.pages(retracted[0].seq_len) + len(running)
                <= slots.free_pages()) and try_resume(slots, retracted[0]):
            running.append(retracted.popleft())
            self.stats.resumptions += 1
        if retracted and running:
            return
        admitted, pages = [], 0
        while waiting and len(running) + len(admitted) < self.max_batch:
            need = slots.pages(len(waiting[0].prompt))
            if pages + need > slots.free_pages():
                break
            pages += need
            admitted.append(waiting.popleft())
        if admitted:
            self._prefill(admitted, running, return_logits)
        elif not running:
            stuck = retracted.popleft() if retracted else waiting.popleft()
            stuck.fail(f"KV pool exhausted: request {stuck.index} needs "
                       f"{slots.pages(max(stuck.seq_len, len(stuck.prompt)))} pages of "
                       f"{slots.page_size} tokens and the empty pool has {slots.free_pages()}")

    # ---- steps ------------------------------------------------------------------------------

    def _prefill(self, reqs: list[Request], running: list[Request], return_logits) -> None:
        began = time.perf_counter()
        cache = self.prefix_cache
        hits = [match_prompt(cache, r) for r in reqs] if cache else [None] * len(reqs)
        starts = [h.tokens if h else 0 for h in hits]
        lens = torch.tensor([len(r.prompt) for r in reqs])
        locs = self.slots.take(reqs, lens.tolist())
        if locs is None:
            raise RuntimeError(f"KV pool or request slots exhausted: prefill of "
                               f"{int(lens.sum())} tokens in {len(reqs)} requests")
        self.slots.clear_state(reqs)
        start, new_locs = 0, []
        for req, hit, k in zip(reqs, hits, starts):
            req.seq_len = len(req.prompt)
            if k:
                load_prefix(self.slots, req, hit)
            new_locs.append(locs[start + k:start + req.seq_len])
            start += req.seq_len
        self._note_usage()
        self.stats.prompt_tokens += int(lens.sum())
        self.stats.prefix_hit_tokens += sum(starts)
        dev = self.device
        new = lens - torch.tensor(starts)
        positions = [p for k, n in zip(starts, lens.tolist()) for p in range(k, n)]
        batch = ForwardBatch(
            ForwardMode.EXTEND, input_ids=torch.tensor(
                [t for r, k in zip(reqs, starts) for t in r.prompt[k:]], device=dev),
            positions=torch.tensor(positions, device=dev),
            out_cache_loc=torch.cat(new_locs),
            req_pool_indices=torch.tensor([r.slot for r in reqs], device=dev),
            seq_lens=lens.to(dev), extend_seq_lens=new.to(dev),
            max_seq_len=max(len(r.prompt) for r in reqs),
            host_positions=positions)
        capture = boundary_capture(reqs, starts, self.slots.page_size, dev) if cache else None
        rings = RingRowCapture(capture.rows) if capture is not None else None
        logits = self.forward(batch, ring_capture=rings)
        if capture is not None:
            insert_prompt_pages(self.slots, cache, capture, rings.states)
        running.extend(reqs)
        self._finish_step(reqs, running, logits, return_logits)
        self.stats.prefill_s.append(time.perf_counter() - began)
        if self.stats.first_token_s is None:
            self.stats.first_token_s = time.perf_counter() - self._started

    def _decode_step(self, running: list[Request], retracted: deque, return_logits) -> None:
        start = time.perf_counter()
        locs = self._alloc_decode(running, retracted)
        if locs is None:  # the one running request could not grow: it failed on its own
            return
        dev = self.device
        lens = torch.tensor([r.seq_len for r in running], device=dev)
        batch = ForwardBatch(ForwardMode.DECODE,
                             input_ids=torch.tensor([r.next_input for r in running], device=dev),
                             positions=lens - 1, out_cache_loc=locs,
                             req_pool_indices=torch.tensor([r.slot for r in running], device=dev),
                             seq_lens=lens, max_seq_len=max(r.seq_len for r in running),
                             host_positions=[r.seq_len - 1 for r in running])
        logits = self._decode_forward(batch)
        self.stats.decode_tokens += len(running)
        self._finish_step(list(running), running, logits, return_logits)
        self.stats.decode_step_s.append(time.perf_counter() - start)

    def _alloc_decode(self, running: list[Request], retracted: deque) -> torch.Tensor | None:
        """One more location per running request (``KVSlots.grow``); retracts the latest admitted
        until they fit (None: the last one alone did not fit and failed)."""
        while True:
            locs = self.slots.grow(running)
            if locs is not None:
                self._note_usage()
                return locs
            if len(running) == 1:
                req = running.pop()
                self.slots.release(req)
                req.fail(f"KV pool exhausted: request {req.index} alone needs more than the "
                         f"pool's {self.allocator.size_full} tokens")
                return None
            victim = running.pop()
            retract(self.slots, victim)
            retracted.appendleft(victim)
            self.stats.retractions += 1

    def _decode_forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graph_runner is None:
            stats = self.pool.swa_loc_stats
            before = (stats.translations, stats.hits)
            logits = self.forward(batch)
            self.stats.eager_swa_translations += stats.translations - before[0]
            self.stats.eager_swa_hits += stats.hits - before[1]
            return logits
        if not self.graph_runner.graphs:
            self.graph_runner.capture()
        self.stats.graph_steps += 1
        # clone: replay returns views of the static outputs
        return self.graph_runner.replay(decode_inputs(batch), self.options).clone()

    def _finish_step(self, stepped: list[Request], running: list[Request], logits: torch.Tensor,
                     return_logits: bool) -> None:
        """Append each stepped request's token; release the finished, evict the rest's SWA."""
        chosen = sample(logits, self._sampling, self._generator)
        for req, row, token in zip(stepped, logits, chosen):
            if return_logits:
                req.logits.append(row.float().cpu())
            req.append(req.forced[len(req.out)] if req.forced else int(token), self.eos_token_id)
            if req.finished:
                running.remove(req)
                self.slots.release(req)
            else:
                self.slots.release_out_of_window(req, req.seq_len)

    def _note_usage(self) -> None:
        (full, swa), s = self.slots.tokens_in_use(), self.stats
        s.peak_full_tokens = max(s.peak_full_tokens, full)
        s.peak_swa_tokens = max(s.peak_swa_tokens, swa)


def _stack_logits(per_request: list[list[torch.Tensor]]) -> torch.Tensor | None:
    """[batch, steps, vocab], NaN where a request stopped early or failed (None if none ran)."""
    ran = [rows for rows in per_request if rows]
    if not ran:
        return None
    steps, vocab = max(len(rows) for rows in ran), ran[0][0].shape[-1]
    out = torch.full((len(per_request), steps, vocab), float("nan"))
    for i, rows in enumerate(per_request):
        if rows:
            out[i, :len(rows)] = torch.stack(rows)
    return out
