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
  positions of a request are).

The metadata holds the step's tensors only: what the step computes with (its ``Options``) is the
forward's own argument, handed down to every layer beside it.

Decode metadata is built with tensor ops only (no host synchronization, shapes fixed by
``max_context_len``), so it can be captured into a graph with the step. The tensors are one
dispatcher op (``torch.ops.dsv4.attention_plan``, whose body is ``attention_plan_ref``): a
step's metadata costs one launch, not a hundred.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from hip_kernels.library import define_op, ops

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
    row_loc: torch.Tensor      # [N, C] compressed locations each query may see (0 where invalid)
    row_valid: torch.Tensor    # [N, C] bool: c < (pos + 1) // ratio
    row_width: torch.Tensor    # [N] the reference's candidate count: seq_len // ratio of the
    #                            query's request, prompt_len // ratio in a chunk of a prompt
    #                            (C may be wider: the rest is padding)


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


def state_ring_rows(req_slots: torch.Tensor, positions: torch.Tensor,
                    ring_size: int) -> torch.Tensor:
    """Ring row of (request slot, position): slot * ring_size + position % ring_size."""
    return req_slots * ring_size + positions % ring_size


def build_attention_metadata(batch: ForwardBatch, req_to_token: torch.Tensor,
                             full_to_swa: torch.Tensor, swa_write_loc: torch.Tensor | None,
                             window: int, ratios: dict[int, int],
                             max_rows: dict[int, int] | None = None) -> AttentionMetadata:
    """``full_to_swa`` is the allocator's mapping tensor: the window's older slots are gathered
    through it directly; ``swa_write_loc`` [N] is the SWA slot of each new token (the pool's
    translation of out_cache_loc), the window's last column; None when the stores translate
    themselves (that column then comes through req_to_token too). ``ratios`` maps each compress
    ratio in the model to its state ring size. ``max_rows`` fixes the number of compressed rows
    per query per ratio (decode under graphs); by default it is the batch's maximum (a host
    read: extend only)."""
    decode = batch.is_decode
    rows_of_token = None if decode else batch.token_request_rows()
    first_new = (None if decode else
                 (batch.seq_lens.long() - batch.extend_seq_lens.long())[rows_of_token])
    tokens = [_plan_tokens(batch, ratio) for ratio in ratios]
    n_rows = [_plan_rows(batch, ratio, None if max_rows is None else max_rows.get(ratio))
              for ratio in ratios]
    out = ops.attention_plan(batch.positions, batch.req_pool_indices, batch.seq_lens,
                             rows_of_token, first_new, req_to_token, full_to_swa, swa_write_loc,
                             window, list(ratios), list(ratios.values()), tokens, n_rows)
    plans = {ratio: CompressPlan(ratio, ring, *out[2 + PLAN_TENSORS * i:][:PLAN_TENSORS])
             for i, (ratio, ring) in enumerate(ratios.items())}
    if batch.prompt_lens is not None and not decode:   # a chunk: the whole prompt's candidates
        for ratio, plan in plans.items():
            plan.row_width = (batch.prompt_lens.long() // ratio)[rows_of_token]
    width = (None if decode else
             prefill_window_width(batch, window)[batch.token_request_rows()])
    return AttentionMetadata(batch.positions.long(), out[0], out[1], plans, swa_write_loc, width)


def _plan_tokens(batch: ForwardBatch, ratio: int) -> torch.Tensor | None:
    """The candidate tokens of a ratio's plan: those closing a window where the positions are
    known on the host (or in an extend); None in a decode step without them (every token: a
    captured step's fixed shape)."""
    if batch.host_positions is not None:
        return torch.tensor([i for i, p in enumerate(batch.host_positions)
                             if (p + 1) % ratio == 0], dtype=torch.int64,
                            device=batch.positions.device)
    if batch.is_decode:
        return None
    return torch.nonzero((batch.positions.long() + 1) % ratio == 0).flatten()


def _plan_rows(batch: ForwardBatch, ratio: int, n_rows: int | None) -> int:
    """Compressed rows per query: given, else the batch's largest visible count (from the
    host's max_seq_len, or read from the positions: extend only)."""
    n = batch.positions.shape[0]
    if n_rows is None and batch.max_seq_len is not None:
        return batch.max_seq_len // ratio if n else 0
    if n_rows is None:
        return int(((batch.positions.long() + 1) // ratio).max()) if n else 0
    return n_rows


def attention_plan_ref(positions, req_pool_indices, seq_lens, rows_of_token, first_new,
                       req_to_token, full_to_swa, swa_write_loc, window, ratios, rings, tokens,
                       n_rows) -> list[torch.Tensor]:
    """The step's metadata tensors: window_loc, window_valid, then per ratio the CompressPlan
    fields from tokens on (``PLAN_TENSORS`` each). rows_of_token / first_new None: a decode
    step's (each request one token, at its position); tokens[i] None: every token."""
    dev = positions.device
    pos = positions.long()
    req = req_pool_indices.long()
    seq_len = seq_lens.long()
    if rows_of_token is not None:
        req, seq_len = req[rows_of_token], seq_len[rows_of_token]
    first_new = pos if first_new is None else first_new
    ctx = req_to_token.shape[1]

    def full_loc(r, p):
        return req_to_token[r, p.clamp(0, ctx - 1)].long()

    gathered = window - (swa_write_loc is not None)     # the newest slot may be given
    q = pos[:, None] - torch.arange(window - 1, window - 1 - gathered, -1, device=dev)
    window_valid = q >= 0                                # oldest first
    swa = full_to_swa[full_loc(req[:, None], q)].to(torch.int32)
    window_loc = torch.where(window_valid, swa, torch.zeros_like(swa))
    if swa_write_loc is not None:
        window_loc = torch.cat([window_loc, swa_write_loc.to(torch.int32)[:, None]], 1)
        window_valid = torch.nn.functional.pad(window_valid, (0, 1), value=True)
    out = [window_loc, window_valid]
    for ratio, ring, tok, rows in zip(ratios, rings, tokens, n_rows):
        tok = torch.arange(pos.shape[0], device=dev) if tok is None else tok
        out += _compress_plan(ratio, ring, tok, pos, req, seq_len, first_new, full_loc, rows)
    return out


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


def _compress_plan(ratio, ring, tokens, pos, req, seq_len, first_new, full_loc, n_rows):
    dev = pos.device
    p = pos[tokens]
    width = ring             # a pool reads as many rows as the ring keeps (8 overlapping at 4)
    qpos = p[:, None] - torch.arange(width - 1, -1, -1, device=dev)        # oldest first
    new = qpos >= first_new[tokens][:, None]
    src_new = torch.where(new, tokens[:, None] - (p[:, None] - qpos), -1)
    ring_rows = state_ring_rows(req[tokens][:, None], qpos, ring)
    src_state = torch.where(~new & (qpos >= 0), ring_rows, -1)
    window_start = p + 1 - ratio
    emit = (p + 1) % ratio == 0
    emit_loc = torch.where(emit, full_loc(req[tokens], window_start) // ratio, -1)
    keep = pos >= seq_len - ring
    state_write = torch.where(keep, state_ring_rows(req, pos, ring), -1)

    visible = (pos + 1) // ratio
    c = torch.arange(n_rows, device=dev)
    row_valid = c[None] < visible[:, None]
    row_loc = torch.where(row_valid, full_loc(req[:, None], c[None] * ratio) // ratio, 0)
    return [tokens, src_state, src_new, p // ratio > 0, window_start, emit_loc, state_write,
            row_loc, row_valid, seq_len // ratio]


def _attention_plan_fake(positions, req_pool_indices, seq_lens, rows_of_token, first_new,
                         req_to_token, full_to_swa, swa_write_loc, window, ratios, rings, tokens,
                         n_rows):
    n = positions.shape[0]
    out = [positions.new_empty(n, window, dtype=torch.int32),
           positions.new_empty(n, window, dtype=torch.bool)]
    for ring, tok, rows in zip(rings, tokens, n_rows):
        m = n if tok is None else tok.shape[0]
        i64 = dict(dtype=torch.int64)
        out += [positions.new_empty(m, **i64), positions.new_empty(m, ring, **i64),
                positions.new_empty(m, ring, **i64), positions.new_empty(m, dtype=torch.bool),
                positions.new_empty(m, **i64), positions.new_empty(m, **i64),
                positions.new_empty(n, **i64), positions.new_empty(n, rows, **i64),
                positions.new_empty(n, rows, dtype=torch.bool), positions.new_empty(n, **i64)]
    return out


PLAN_TENSORS = 10     # CompressPlan's tensor fields, tokens .. row_width
define_op("attention_plan", "(Tensor positions, Tensor req_pool_indices, Tensor seq_lens, "
          "Tensor? rows_of_token, Tensor? first_new, Tensor req_to_token, Tensor full_to_swa, "
          "Tensor? swa_write_loc, int window, int[] ratios, int[] rings, Tensor?[] tokens, "
          "int[] n_rows) -> Tensor[]", attention_plan_ref, _attention_plan_fake)
