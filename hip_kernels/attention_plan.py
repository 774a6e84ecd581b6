"""A step's attention plan as one dispatcher op (`torch.ops.dsv4.attention_plan`): the paged-table
arithmetic that says, for each new token of a step, which KV rows it attends and where they live,
and what each compress ratio's compressor reads and writes. The model builds it once per step
and every layer shares it (`dsv4.attention_metadata`, which names what each output means).

Its outputs, from the step's positions, request slots and lengths, the request -> location table
`req_to_token` and the full -> SWA slot mapping `full_to_swa`:

- window_loc [N, W] int32, window_valid [N, W] bool: the SWA slots of the token's last W
  positions, oldest first (0 where the position is negative); the newest column is
  `swa_write_loc` when it is given;
- per compress ratio r (ring size R, n_rows compressed rows per query), ``PLAN_TENSORS`` tensors:
  tokens [M] (the candidates), src_state / src_new [M, R] (the ring row, or the step's token,
  each pooled row comes from; -1 for the other), has_prev [M], window_start [M], emit_loc [M]
  (`req_to_token` of the window's first position // r, -1 off a boundary), state_write [N] (the
  ring row each token's (kv, score) goes to, -1: not kept), row_loc / row_valid [R, n_rows]
  (`req_to_token` of c * r, // r, for the rows c that exist; 0 elsewhere), row_width [N]
  (seq_len // r). In a decode step R = N, a row per token, c < (pos + 1) // r; in an extend
  R = B, a row per request, c < seq_len // r (its tokens' visibility is their positions'), so
  an extend's tables grow with its requests times their context, not with its tokens.

A ratio's ring rows (src_state, state_write) are addressed one of two ways, its ``ring_pages``
entry: 0, by request slot (row = slot * R + position % R, a ring per request); P > 0, by SWA
page (row = (s // P) * R + s % R, s the position's SWA slot `full_to_swa[req_to_token[slot,
position]]` and P the SWA page size, a multiple of R: a ring per SWA page, so a state buffer
sized by the SWA pages; a padded row of request 0 at position 0 lands on the ring of the SWA
page its location 0 maps to).

The torch body (`attention_plan_ref`) is the CPU path and the oracle: about 115 aten ops, each a
kernel on a GPU. The Triton backend (`attention_plan_triton`) plans a decode step (one token per
request: ``rows_of_token`` and ``first_new`` None) in one launch per ratio, the window folded
into the first: its outputs are the reference's, byte for byte. An extend step (shaped on the
host, never captured) runs the torch body whatever backend is asked: `attention_plan` resolves
it so. No HIP version.
"""

from __future__ import annotations

import torch

from .backend import resolve
from .checks import check_kernel, check_tensor
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions

OP = "attention_plan"
PLAN_TENSORS = 10     # per ratio: tokens, src_state, src_new, has_prev, window_start, emit_loc,
#                       state_write, row_loc, row_valid, row_width
INDEX_DTYPES = (torch.int32, torch.int64)


def state_ring_rows(req_slots: torch.Tensor, positions: torch.Tensor,
                    ring_size: int) -> torch.Tensor:
    """Ring row of (request slot, position): slot * ring_size + position % ring_size."""
    return req_slots * ring_size + positions % ring_size


def state_page_rows(swa_slots: torch.Tensor, ring_size: int, ring_page: int) -> torch.Tensor:
    """Ring row of an SWA slot, a ring per SWA page of ring_page slots:
    (slot // ring_page) * ring_size + slot % ring_size."""
    return swa_slots // ring_page * ring_size + swa_slots % ring_size


def attention_plan_ref(positions, req_pool_indices, seq_lens, rows_of_token, first_new,
                       req_to_token, full_to_swa, swa_write_loc, window, ratios, rings, tokens,
                       n_rows, ring_pages) -> list[torch.Tensor]:
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
    for ratio, ring, tok, rows, page in zip(ratios, rings, tokens, n_rows, ring_pages):
        tok = torch.arange(pos.shape[0], device=dev) if tok is None else tok
        out += _compress_plan(ratio, ring, tok, pos, req, seq_len, first_new, full_loc, rows,
                              None if rows_of_token is None else req_pool_indices.long(),
                              seq_lens.long(), _ring_rows(ring, page, full_to_swa, full_loc))
    return out


def _ring_rows(ring, page, full_to_swa, full_loc):
    """A ratio's ring_rows(request slots, positions): by request slot (page 0), else by the SWA
    page of each position's SWA slot."""
    if page:
        return lambda r, p: state_page_rows(full_to_swa[full_loc(r, p)].long(), ring, page)
    return lambda r, p: state_ring_rows(r, p, ring)


def _compress_plan(ratio, ring, tokens, pos, req, seq_len, first_new, full_loc, n_rows,
                   extend_req, extend_seq_len, ring_rows):
    """extend_req / extend_seq_len [B]: an extend's requests and lengths (None in a decode
    step): the row table then has one row per request, its rows c < seq_len // ratio valid.
    ring_rows(request slots, positions): their ring rows."""
    dev = pos.device
    p = pos[tokens]
    width = ring             # a pool reads as many rows as the ring keeps (8 overlapping at 4)
    qpos = p[:, None] - torch.arange(width - 1, -1, -1, device=dev)        # oldest first
    new = qpos >= first_new[tokens][:, None]
    src_new = torch.where(new, tokens[:, None] - (p[:, None] - qpos), -1)
    src_state = torch.where(~new & (qpos >= 0), ring_rows(req[tokens][:, None], qpos), -1)
    window_start = p + 1 - ratio
    emit = (p + 1) % ratio == 0
    emit_loc = torch.where(emit, full_loc(req[tokens], window_start) // ratio, -1)
    keep = pos >= seq_len - ring
    state_write = torch.where(keep, ring_rows(req, pos), -1)

    owner, visible = ((req, (pos + 1) // ratio) if extend_req is None else
                      (extend_req, extend_seq_len // ratio))
    c = torch.arange(n_rows, device=dev)
    row_valid = c[None] < visible[:, None]
    row_loc = torch.where(row_valid, full_loc(owner[:, None], c[None] * ratio) // ratio, 0)
    return [tokens, src_state, src_new, p // ratio > 0, window_start, emit_loc, state_write,
            row_loc, row_valid, seq_len // ratio]


def _attention_plan_fake(positions, req_pool_indices, seq_lens, rows_of_token, first_new,
                         req_to_token, full_to_swa, swa_write_loc, window, ratios, rings, tokens,
                         n_rows, ring_pages):
    n = positions.shape[0]
    r = n if rows_of_token is None else req_pool_indices.shape[0]   # the row tables' rows
    out = [positions.new_empty(n, window, dtype=torch.int32),
           positions.new_empty(n, window, dtype=torch.bool)]
    for ring, tok, rows in zip(rings, tokens, n_rows):
        m = n if tok is None else tok.shape[0]
        i64 = dict(dtype=torch.int64)
        out += [positions.new_empty(m, **i64), positions.new_empty(m, ring, **i64),
                positions.new_empty(m, ring, **i64), positions.new_empty(m, dtype=torch.bool),
                positions.new_empty(m, **i64), positions.new_empty(m, **i64),
                positions.new_empty(n, **i64), positions.new_empty(r, rows, **i64),
                positions.new_empty(r, rows, dtype=torch.bool), positions.new_empty(n, **i64)]
    return out


define_op(OP, "(Tensor positions, Tensor req_pool_indices, Tensor seq_lens, "
          "Tensor? rows_of_token, Tensor? first_new, Tensor req_to_token, Tensor full_to_swa, "
          "Tensor? swa_write_loc, int window, int[] ratios, int[] rings, Tensor?[] tokens, "
          "int[] n_rows, int[] ring_pages) -> Tensor[]", attention_plan_ref, _attention_plan_fake,
          triton="attention_plan_triton.attention_plan_triton")


def attention_plan(positions: torch.Tensor, req_pool_indices: torch.Tensor,
                   seq_lens: torch.Tensor, rows_of_token: torch.Tensor | None,
                   first_new: torch.Tensor | None, req_to_token: torch.Tensor,
                   full_to_swa: torch.Tensor, swa_write_loc: torch.Tensor | None, window: int,
                   ratios: list[int], rings: list[int], tokens: list[torch.Tensor | None],
                   n_rows: list[int], ring_pages: list[int], *,
                   kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> list[torch.Tensor]:
    """The step's plan tensors (see the module docstring): positions [N]; req_pool_indices and
    seq_lens [N] in a decode step, [B] in an extend, whose rows_of_token [N] give each token's
    request row and first_new [N] its request's first new position (both None: a decode step);
    req_to_token [slots, context]; full_to_swa [full locations]; swa_write_loc [N] or None;
    per ratio its ring size, its candidate tokens (None: every token), its compressed rows
    per query and how its ring rows are addressed (0: by request slot; else by SWA page, the
    SWA page size, a positive multiple of the ring size). kernel.backend picks the backend (no HIP version); an extend runs the torch
    reference. No host read: a decode step's plan can be captured."""
    check_kernel(kernel)
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, dim=1)
    dev, n = positions.device, positions.shape[0]
    decode = rows_of_token is None and first_new is None
    rows = (n,) if decode else (None,)
    check_tensor("req_pool_indices", req_pool_indices, dtypes=INDEX_DTYPES, shape=rows, device=dev)
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=rows, device=dev)
    check_tensor("req_to_token", req_to_token, dtypes=INDEX_DTYPES, dim=2, device=dev)
    check_tensor("full_to_swa", full_to_swa, dtypes=INDEX_DTYPES, dim=1, device=dev)
    if swa_write_loc is not None:
        check_tensor("swa_write_loc", swa_write_loc, dtypes=INDEX_DTYPES, shape=(n,), device=dev)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    if not len(ratios) == len(rings) == len(tokens) == len(n_rows) == len(ring_pages):
        raise ValueError(f"ratios, rings, tokens, n_rows and ring_pages must have one entry per "
                         f"ratio, got {len(ratios)}, {len(rings)}, {len(tokens)}, {len(n_rows)} "
                         f"and {len(ring_pages)}")
    for ratio, ring, page in zip(ratios, rings, ring_pages):
        if isinstance(page, bool) or not isinstance(page, int) or page < 0 or page % ring:
            raise ValueError(f"ring_pages must hold 0 (ring rows by request slot) or an SWA page "
                             f"size that is a positive multiple of the ring size per ratio; ratio "
                             f"{ratio} (ring {ring}) has {page!r}")
    backend = resolve(OP, dev, kernel.backend, triton_ok=decode)
    return op(OP, backend)(positions, req_pool_indices, seq_lens, rows_of_token, first_new,
                           req_to_token, full_to_swa, swa_write_loc, window, list(ratios),
                           list(rings), list(tokens), list(n_rows), list(ring_pages))
