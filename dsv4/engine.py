"""A small batch-synchronous engine: admit prompts into the paged pools, prefill them in chunks,
decode the running requests between the chunks.

``Engine(model, max_total_tokens=... | kv_bytes=...)`` owns its KV slots (``kv_slots.py``: the
pool and allocator of ``mem_pool``, sized from a token count or a byte budget, and the request ->
token table), which every request's pages and slot come from and go back to.

``generate`` runs steps until every request is done. Each step has a budget of ``prefill_chunk``
tokens (``Engine(prefill_chunk=...)``, ``Options.prefill_chunk``, DSV4_PREFILL_CHUNK; 0 = sized
from the device's memory by ``memory_estimate.auto_prefill_chunk``): first one decode forward of
every running request (one token each: greedy, sampled as ``sampling`` says, or the
``forced_tokens`` given), then one extend forward over chunks of the prompts being prefilled,
oldest first, with what is left of the budget, but never less than ``min_prefill_share`` (an
eighth of the chunk, at least ``prefix_reuse.RING`` = 8 tokens) so a prompt always progresses
however many requests decode. A chunk is an extend over the request's positions already in the
cache; only a prompt's last chunk yields its first token, and the request joins the decode
batch. A prompt is admitted (pages checked against everything the admitted prompts still have to
take, then a slot and the pages of its first chunk) when its turn comes and they fit; each later
chunk takes its own pages, and SWA pages that leave the window are released after every chunk
and every decode step, so a prefilling request holds about chunk + window SWA slots.

A request stops at max_new_tokens or ``eos_token_id``; its pages are freed at once and it leaves
the batch. When a step finds the pool exhausted, the latest admitted prompt still prefilling goes
back to the queue (its pages freed; it starts again when its turn comes) or, when none is, the
latest admitted running request is retracted to the host (``retraction.py``) and resumed when
pages free up. Decode steps replay captured graphs (``graphs/decode_runner.py``) when
``options.graph`` (DSV4_GRAPH) is on. With a prefix cache (``prefix_cache=`` or
DSV4_PREFIX_CACHE) a prompt's cached prefix is loaded instead of prefilled, and every whole page
a chunk computes is inserted (``prefix_reuse.py``). A chunk ends on a multiple of the compressor
ring (``prefix_reuse.RING``, 8) unless it ends the prompt (``Scheduler.piece``): a page end's
ring rows are then always computed by one chunk, and a step's rows come in multiples of 8.

Flags are read once, when the engine is made: ``Engine(model, options=None)`` takes
``Options.from_env()`` then, and hands that value to every forward, to its graphs and to its
prefix cache; a flag changed afterwards changes nothing in this engine (pass ``options=`` or make
another engine).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hip_kernels.checks import trusted_locations
from mem_pool.kv_cache_spec import KVCacheSpec

from .forward_batch import ForwardBatch, ForwardMode
from .graphs.decode_runner import decode_inputs, make_decode_graph_runner
from .kv_slots import KVSlots
from .memory_estimate import auto_prefill_chunk, available_bytes
from .options import Options
from .paged_attention import RingRowCapture
from .prefix_reuse import (RING, boundary_capture, insert_prompt_pages,
                           prefix_cache_from_options)
from .request import Request
from .request_checks import check_call, request_error
from .sampling import GREEDY, SamplingParams, sample
from .scheduler import Scheduler

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
    first_token_s: float | None = None   # from generate() to the first prompt's first token
    graph_steps: int = 0                 # decode steps that replayed a graph
    eager_swa_translations: int = 0      # SWA gathers run by eager decode steps
    eager_swa_hits: int = 0              # SWA location cache hits of eager decode steps
    retractions: int = 0
    resumptions: int = 0
    peak_full_tokens: int = 0            # most full-pool token slots in use at once
    peak_swa_tokens: int = 0
    prefill_s: list[float] = field(default_factory=list)  # wall time of each prefill step
    prefill_chunks: list[int] = field(default_factory=list)  # prompt tokens of each such step
    requeued: int = 0                    # prefilling prompts sent back to the queue
    prompt_tokens: int = 0               # prompt tokens admitted (again when requeued)
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
                 graph: bool | None = None, prefix_cache=None, options: Options | None = None,
                 prefill_chunk: int | None = None):
        """prefix_cache: a ``mem_pool.prefix.PrefixCache`` of this page size and window,
        False for none, or None to follow options.prefix_cache (off by default). graph: capture
        and replay decode steps; None follows options.graph. options: what every step computes
        with (a ``dsv4.Options``); None reads the DSV4_* flags now, once. prefill_chunk: the
        token budget of a step (the most prompt tokens one extend computes); 0 sizes it from the
        device's memory, None follows options.prefill_chunk."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(
                prefill_chunk, int) or prefill_chunk < 0):
            raise ValueError(f"prefill_chunk must be an int >= 1, 0 (sized from the device's "
                             f"memory) or None (options.prefill_chunk), got {prefill_chunk!r}")
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
        chunk = self.options.prefill_chunk if prefill_chunk is None else prefill_chunk
        self.prefill_chunk = chunk or auto_prefill_chunk(
            cfg, self.max_context_len, available_bytes(self.device),
            self.pool.nbytes + sum(t.numel() * t.element_size()
                                   for t in (*model.parameters(), *model.buffers())), page_size,
            batch=max_batch, tp=model.split.size)
        self.min_prefill_share = max(self.prefill_chunk // 8, RING)
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
        q = Scheduler(self.slots, self.prefix_cache, self.max_batch, self.stats,
                      [r for r in reqs if r.error is None])
        try:
            while q.busy:
                q.resume()
                if q.running:
                    self._decode_step(q, return_logits)
                    if on_step is not None:
                        on_step()
                self._prefill_step(q, return_logits)
        finally:
            for req in q.running + q.prefilling:
                slots.release(req)
        logits = _stack_logits([r.logits for r in reqs]) if return_logits else None
        return GenerateOutput([r.out for r in reqs], logits, [r.error for r in reqs])

    # ---- steps ------------------------------------------------------------------------------

    def _prefill_step(self, q: Scheduler, return_logits) -> None:
        """One extend forward over the next chunks of the prefilling prompts, then of newly
        admitted ones, within the step's budget: the chunk less the decodes of this step, at
        least min_prefill_share."""
        began = time.perf_counter()
        budget = max(self.prefill_chunk - len(q.running), self.min_prefill_share)
        pieces = q.next_chunks(budget)
        budget -= sum(len(locs) for _, _, locs in pieces)
        if not q.retracted or not (q.running or q.prefilling):
            pieces += q.admit(budget)
        if not pieces:
            if not (q.running or q.prefilling) and (q.retracted or q.waiting):
                q.resume()     # the last running request may have just finished
                if not q.running:
                    q.fail_stuck()
            return
        self._note_usage()
        reqs = [req for req, _, _ in pieces]
        starts = [k for _, k, _ in pieces]
        ends = [k + len(locs) for _, k, locs in pieces]
        dev = self.device
        positions = [p for k, e in zip(starts, ends) for p in range(k, e)]
        batch = ForwardBatch(
            ForwardMode.EXTEND, input_ids=torch.tensor(
                [t for r, k, e in zip(reqs, starts, ends) for t in r.prompt[k:e]], device=dev),
            positions=torch.tensor(positions, device=dev),
            out_cache_loc=torch.cat([locs for _, _, locs in pieces]),
            req_pool_indices=torch.tensor([r.slot for r in reqs], device=dev),
            seq_lens=torch.tensor(ends, device=dev),
            extend_seq_lens=torch.tensor([e - k for k, e in zip(starts, ends)], device=dev),
            max_seq_len=max(len(r.prompt) for r in reqs), host_positions=positions,
            prompt_lens=torch.tensor([len(r.prompt) for r in reqs], device=dev))
        cache = self.prefix_cache
        capture = (boundary_capture(reqs, starts, ends, self.slots.page_size, dev)
                   if cache else None)
        rings = RingRowCapture(capture.rows) if capture is not None else None
        logits = self.forward(batch, ring_capture=rings)
        if capture is not None:
            insert_prompt_pages(self.slots, cache, capture, rings.states)
        done = []
        for i, (req, end) in enumerate(zip(reqs, ends)):
            req.seq_len = end
            if end == len(req.prompt):
                done.append(i)
                q.prefilling.remove(req)
                q.running.append(req)
            else:
                self.slots.release_out_of_window(req, end)
        if done:
            self._finish_step([reqs[i] for i in done], q.running, logits[done], return_logits)
        self.stats.prefill_chunks.append(len(positions))
        self.stats.prefill_s.append(time.perf_counter() - began)
        if done and self.stats.first_token_s is None:
            self.stats.first_token_s = time.perf_counter() - self._started

    def _decode_step(self, q: Scheduler, return_logits) -> None:
        start = time.perf_counter()
        locs = self._alloc_decode(q)
        if locs is None:  # the one running request could not grow: it failed on its own
            return
        batch = self._decode_batch(q.running, locs)
        self.slots.write_grown(batch.req_pool_indices, batch.positions, batch.out_cache_loc,
                               batch.max_seq_len - 1)
        logits = self._decode_forward(batch)
        self.stats.decode_tokens += len(q.running)
        self._finish_step(list(q.running), q.running, logits, return_logits)
        self.stats.decode_step_s.append(time.perf_counter() - start)

    def _decode_batch(self, running: list[Request], locs: list[int]) -> ForwardBatch:
        """The decode step's inputs, all known on the host, in one host -> device copy: a
        [5, B] int64 tensor whose rows are the batch's tensors (views)."""
        positions = [r.seq_len - 1 for r in running]
        host = [[r.next_input for r in running], positions, [r.seq_len for r in running],
                [r.slot for r in running], locs]
        with torch.inference_mode(False):  # a versioned tensor: the SWA location cache's key
            rows = torch.tensor(host, dtype=torch.int64, device=self.device)
        input_ids, positions_d, seq_lens, slots, out_cache_loc = rows.unbind(0)
        return ForwardBatch(ForwardMode.DECODE, input_ids=input_ids, positions=positions_d,
                            out_cache_loc=out_cache_loc, req_pool_indices=slots,
                            seq_lens=seq_lens, max_seq_len=max(positions) + 1,
                            host_positions=positions)

    def _alloc_decode(self, q: Scheduler) -> list[int] | None:
        """One more host location per running request (``KVSlots.grow``); requeues the latest
        prefilling prompt, else retracts the latest admitted running request, until they fit
        (None: the last one alone did not fit and failed)."""
        running = q.running
        while True:
            locs = self.slots.grow(running)
            if locs is not None:
                self._note_usage()
                return locs
            if q.prefilling:
                q.requeue()
                continue
            if len(running) == 1:
                req = running.pop()
                self.slots.release(req)
                req.fail(f"KV pool exhausted: request {req.index} alone needs more than the "
                         f"pool's {self.allocator.size_full} tokens")
                return None
            q.retract()

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
