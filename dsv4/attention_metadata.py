"""Attention metadata: built once per step from the batch, shared by every layer.

For each new token (a query) it says which KV rows it attends and where they live:

- the sliding window: the SWA slots of its request's last ``window`` positions (itself included),
  via req_to_token -> full location -> SWA slot; the newest of them, the slot its own KV row is
  stored at (``swa_write_loc``), is the pool's translation of ``out_cache_loc``, made once per
  step and shared by every layer's store and every layer's window; and, in an extend, how many
  window columns the reference's attention walks before the compressed rows (``window_width``:
  a prompt of L < window tokens passes min(L, window) columns, valid rows first, in its one
  extend or in each of its chunks, so its compressed rows start in an earlier 64-row block);
- per compress ratio r present in the model: the compressed rows c < (pos + 1) // r, at
  compressed-cache location ``full_loc(c * r) // r`` (a full page maps to one compressed page);
- per ratio, the compressor plan: for each candidate token, the ``window_rows`` (kv, score) rows
  its pool reads, either from the request's state ring (positions before this step) or from this
  step's own projections; the compressed location it emits to (-1 when it is not on a boundary);
  and the ring row each new token's (kv, score) goes to (-1: not kept, only the last ring_size
  positions of a request are). A ratio's ring rows are its request slot's ring (our pool's) or,
  where the pool says so (``state_ring_swa_page``), the ring of the position's SWA page.

The metadata holds the step's tensors only: what the step computes with (its ``Options``) is the
forward's own argument, handed down to every layer beside it.

Decode metadata is built with tensor ops only (no host synchronization, shapes fixed by
``max_context_len``), so it can be captured into a graph with the step. The tensors are one
dispatcher op (``hip_kernels.attention_plan``, the paged-table arithmetic): on Triton a decode
step's metadata is one Triton launch per compress ratio, not a hundred torch kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from hip_kernels.attention_plan import PLAN_TENSORS, attention_plan
from hip_kernels.options import KernelOptions

from .forward_batch import ForwardBatch


@dataclass
class CompressPlan:
    ratio: int
    ring_size: int
    tokens: torch.Tensor       # [M] batch token index of each candidate: the tokens closing a
    #                            window (in a captured decode step: every token)
    src_state: torch.Tensor    # [M, R] state-ring row of each pooled row, -1 = from this step
    src_new: torch.Tensor      # [M, R] batch token index of each pooled row, -1 = from the ring
    has_prev: torch.Tensor     # [M] the previous window exists (overlap pooling)
    window_start: torch.Tensor  # [M] position of the window's first token (RoPE of the row)
    emit_loc: torch.Tensor     # [M] compressed location written, -1 = not a boundary
    state_write: torch.Tensor  # [N] state-ring row of each new token's (kv, score), -1 = skip
    row_loc: torch.Tensor      # [R, C] compressed location of each row c (0 where invalid)
    row_valid: torch.Tensor    # [R, C] bool: row c exists
    row_width: torch.Tensor    # [N] the reference's candidate count: seq_len // ratio of the
    #                            query's request, prompt_len // ratio in a chunk of a prompt
    #                            (C may be wider: the rest is padding)
    positions: torch.Tensor    # [N] int64, the queries' positions
    # [N] the row of row_loc each query reads (its request, R = the batch's requests) in an
    # extend; None in a decode step, whose R = N rows are the queries' own (c < (pos + 1) //
    # ratio: each token sees what its position has closed). An extend's tables are thus sized
    # by its requests times their context, never by its tokens times the context.
    row_request: torch.Tensor | None = None

    @property
    def n_rows(self) -> int:
        """C, the compressed rows per query the plan is sized for."""
        return self.row_loc.shape[1]

    def candidates(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(locations [n, C], visible [n, C]) of the compressed rows the queries in ``rows``
        may see: row c of the query's request where c < (pos + 1) // ratio. In an extend they
        are made here for these queries only (the caller bounds n * C)."""
        if self.row_request is None:
            return self.row_loc[rows], self.row_valid[rows]
        c = torch.arange(self.n_rows, device=self.row_loc.device)
        visible = c[None] < ((self.positions[rows] + 1) // self.ratio)[:, None]
        return self.row_loc[self.row_request[rows]], visible

    def request_runs(self, rows: slice) -> list[tuple[slice, int]]:
        """An extend's queries in ``rows`` by request: (their slice within rows, their row of
        row_loc), in order (a host read: extend only)."""
        requests, counts = torch.unique_consecutive(self.row_request[rows], return_counts=True)
        runs, start = [], 0
        for request, count in zip(requests.tolist(), counts.tolist()):
            runs.append((slice(start, start + count), request))
            start += count
        return runs


@dataclass
class AttentionMetadata:
    positions: torch.Tensor      # [N]
    window_loc: torch.Tensor     # [N, W] SWA slots, oldest first (0 where invalid)
    window_valid: torch.Tensor   # [N, W]
    plans: dict[int, CompressPlan]
    swa_write_loc: torch.Tensor | None  # [N] SWA slot each new token's KV row is stored at
    #                                     (int32, = window_loc[:, -1]); None: the store kernels
    #                                     translate out_cache_loc themselves
    window_width: torch.Tensor | None = None  # [N] window columns before the compressed rows
    #                                     (extend only; None: all W, as every decode step)


def build_attention_metadata(batch: ForwardBatch, req_to_token: torch.Tensor,
                             full_to_swa: torch.Tensor, swa_write_loc: torch.Tensor | None,
                             window: int, ratios: dict[int, int],
                             max_rows: dict[int, int] | None = None, *,
                             ring_pages: dict[int, int], kernel: KernelOptions
                             ) -> AttentionMetadata:
    """``full_to_swa`` is the allocator's mapping tensor: the window's older slots are gathered
    through it directly; ``swa_write_loc`` [N] is the SWA slot of each new token (the pool's
    translation of out_cache_loc), the window's last column; None when the stores translate
    themselves (that column then comes through req_to_token too). ``ratios`` maps each compress
    ratio in the model to its state ring size. ``max_rows`` fixes the number of compressed rows
    per query per ratio (decode under graphs); by default it is the batch's maximum (a host
    read: extend only). ``ring_pages`` maps a ratio whose state ring rows go by SWA page to the
    SWA page size (the pool's ``state_ring_swa_page``); a ratio not in it has a ring per request
    slot. ``kernel.backend`` picks the plan's backend."""
    decode = batch.is_decode
    rows_of_token = None if decode else batch.token_request_rows()
    first_new = (None if decode else
                 (batch.seq_lens.long() - batch.extend_seq_lens.long())[rows_of_token])
    tokens = _plan_tokens(batch, list(ratios))
    n_rows = [_plan_rows(batch, ratio, None if max_rows is None else max_rows.get(ratio))
              for ratio in ratios]
    out = attention_plan(batch.positions, batch.req_pool_indices, batch.seq_lens, rows_of_token,
                         first_new, req_to_token, full_to_swa, swa_write_loc, window,
                         list(ratios), list(ratios.values()), tokens, n_rows,
                         [ring_pages.get(ratio, 0) for ratio in ratios], kernel=kernel)
    pos = batch.positions.long()
    plans = {ratio: CompressPlan(ratio, ring, *out[2 + PLAN_TENSORS * i:][:PLAN_TENSORS],
                                 positions=pos, row_request=rows_of_token)
             for i, (ratio, ring) in enumerate(ratios.items())}
    if batch.prompt_lens is not None and not decode:   # a chunk: the whole prompt's candidates
        for ratio, plan in plans.items():
            plan.row_width = (batch.prompt_lens.long() // ratio)[rows_of_token]
    width = None if decode else prefill_window_width(batch, window)[rows_of_token]
    return AttentionMetadata(pos, out[0], out[1], plans, swa_write_loc, width)


def _plan_tokens(batch: ForwardBatch, ratios: list[int]) -> list[torch.Tensor | None]:
    """The candidate tokens of each ratio's plan: those closing a window where the positions
    are known on the host (every ratio's in one host -> device copy, then views), or in an
    extend; None in a decode step without them (every token: a captured step's fixed shape)."""
    if batch.host_positions is not None:
        closing = [[i for i, p in enumerate(batch.host_positions) if (p + 1) % ratio == 0]
                   for ratio in ratios]
        packed = torch.tensor([i for c in closing for i in c], dtype=torch.int64,
                              device=batch.positions.device)
        return list(packed.split([len(c) for c in closing]))
    if batch.is_decode:
        return [None] * len(ratios)
    return [torch.nonzero((batch.positions.long() + 1) % ratio == 0).flatten()
            for ratio in ratios]


def _plan_rows(batch: ForwardBatch, ratio: int, n_rows: int | None) -> int:
    """Compressed rows per query: given, else the batch's largest visible count (from the
    host's max_seq_len, or read from the positions: extend only)."""
    n = batch.positions.shape[0]
    if n_rows is None and batch.max_seq_len is not None:
        return batch.max_seq_len // ratio if n else 0
    if n_rows is None:
        return int(((batch.positions.long() + 1) // ratio).max()) if n else 0
    return n_rows


def prefill_window_width(batch: ForwardBatch, window: int) -> torch.Tensor:
    """[B] window columns of each request of an extend, as the reference passes them: it
    prefills a prompt of L tokens in one step from position 0, whose queries walk min(L, window)
    columns (a decode step always passes window). A chunk of a prompt (``batch.prompt_lens``)
    walks those of its whole prompt, whichever chunk it is; without prompt_lens, a request whose
    L new tokens start at position 0 is a whole prompt, and one that extends a cached prefix
    passes window."""
    if batch.prompt_lens is not None:
        return batch.prompt_lens.long().clamp(max=window)
    new = batch.extend_seq_lens.long()
    from_start = batch.seq_lens.long() == new
    return torch.where(from_start, new.clamp(max=window), window)
