"""The attention of one layer over the paged caches, in one place: ``PagedAttention`` binds the
layer's views of the pool once, stores the window KV row at the step's SWA write slot, runs the
compressors (on side streams when asked), the indexer selection, the gather of the window and
compressed rows and the sparse attention. The math lives in ``dsv4.layers``; this file moves rows
between it and the caches, following the step's ``AttentionMetadata`` (where the rows are) and
its ``Options`` (the numerics, the kernels' options and the prepare mode), both given to each
call. Every store is one ``hip_kernels`` call on the layer's buffer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from hip_kernels import DEFAULT_KERNEL_OPTIONS, KernelOptions, kv_layout, set_kv
from hip_kernels.decode_attention import sparse_decode_attention
from hip_kernels.indexer_scores import indexer_scores, indexer_scores_shared
from hip_kernels.indexer_topk import picked_rows
from hip_kernels.platform import Fp8Dialect

from . import streams

from .attention_metadata import AttentionMetadata, CompressPlan
from .layers.attention import Attention
from .layers.compressor import Compressor
from .layers.indexer import Indexer
from .options import Options

# An extend attends its queries in pieces, so that what a piece holds stays bounded whatever the
# context: at most EXTEND_PIECE queries; at most EXTEND_SCORE_PAIRS (query, candidate row) pairs
# for the indexer (each pair's location, visibility and score: a candidate is any compressed
# row of the context, up to a quarter of the prompt); at most EXTEND_ROW_PAIRS (query, attended
# row) pairs for the attention (each a dequantized 512-wide fp32 row: 2 KiB).
EXTEND_PIECE = 256
EXTEND_SCORE_PAIRS = 2 ** 20
EXTEND_ROW_PAIRS = 2 ** 14


def extend_piece(window: int, candidates: int, attended: int) -> int:
    """Queries per piece of an extend over a layer whose queries attend ``window`` window rows
    and ``attended`` compressed rows, chosen among ``candidates`` by the indexer (0 for a
    layer without one)."""
    piece = min(EXTEND_PIECE, EXTEND_ROW_PAIRS // (window + attended))
    if candidates:
        piece = min(piece, EXTEND_SCORE_PAIRS // candidates)
    return max(piece, 1)


def layer_extend_piece(attn: Attention, window: int, plan: CompressPlan | None) -> int:
    """``extend_piece`` of this layer's attention in a step whose compress plan is ``plan``."""
    rows = 0 if plan is None else plan.n_rows
    if attn.indexer is None:
        return extend_piece(window, 0, rows)
    return extend_piece(window, rows, min(attn.indexer.topk, rows))


@dataclass
class LayerCaches:
    """One layer's buffers in the pool. State rings are flattened to [slots * ring, width] rows
    (row = req_pool_idx * ring + position % ring; the last row is the pool's scratch row). The
    indexer's keys lie in the order the pool's ``indexer_key_tile`` names
    (``kv_layout.INDEX_KEY_TILES``: 0 row-major, 16 in 16 x 16 tiles)."""
    swa: torch.Tensor
    swa_page_size: int
    compressed: torch.Tensor | None = None
    compressed_page_size: int = 0
    state: torch.Tensor | None = None
    index: torch.Tensor | None = None
    index_page_size: int = 0
    index_key_tile: int = 0
    index_state: torch.Tensor | None = None

    @classmethod
    def of(cls, pool, layer_id: int, ratio: int) -> "LayerCaches":
        c = cls(pool.get_swa_cache(layer_id), pool.page_size)
        if ratio:
            c.compressed = pool.get_compressed_cache(layer_id)
            c.compressed_page_size = pool.compressed_page_size(layer_id)
            c.state = _rows(pool.get_compressor_state(layer_id))
        if ratio == 4:
            c.index = pool.get_indexer_cache(layer_id)
            c.index_page_size = c.compressed_page_size
            c.index_key_tile = pool.indexer_key_tile
            c.index_state = _rows(pool.get_indexer_compressor_state(layer_id))
        return c


def _rows(state: torch.Tensor) -> torch.Tensor:
    return state.view(-1, state.shape[-1])


@dataclass
class RingRowCapture:
    """An extend's request for ratio-4 compressor ring rows (the prefix cache rebuilds a
    request's rings at a page boundary from them): ``rows``, the batch token indices to hand
    back; ``states``, filled by the forward: table name ("compressor_state",
    "indexer_compressor_state") -> layer -> rows [len(rows), 2 * width]."""
    rows: torch.Tensor
    states: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    def keep(self, table: str, layer_id: int, new: torch.Tensor) -> None:
        self.states.setdefault(table, {})[layer_id] = new[self.rows].clone()


def run_compressor(comp: Compressor, x: torch.Tensor, plan: CompressPlan, state: torch.Tensor,
                   store, freqs_cis: torch.Tensor, reference: bool,
                   kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """One step of a compressor (two ops and the store): pool every candidate's window (rows
    from the state ring or from this step, the position bias added to their scores), keep this
    step's (kv, score) rows in the ring, emit the boundary rows through ``store(rows, loc)``
    (negative loc = skip). state: fp32 [ring rows, 2 * width]; reference: the reference
    numerics; kernel: the two ops' kernel options. Returns this step's (kv, score) rows
    [N, 2 * width] (score: the raw gate output), the rows a ring would keep."""
    new = comp.project(x, kernel)
    out = comp.update(new, state, plan, freqs_cis, x.dtype, reference, kernel)
    if plan.tokens.numel():              # a shape, known on the host: no window closes here
        store(out, plan.emit_loc)
    return new


def select_rows(indexer: Indexer, qr, x, freqs_cis, positions, plan: CompressPlan,
                rows: slice, caches: LayerCaches,
                options: Options) -> tuple[torch.Tensor, torch.Tensor]:
    """(compressed locations [n, k], valid [n, k]) the indexer keeps for the queries in rows (qr,
    x, positions: theirs; freqs_cis: the layer's RoPE table; caches: the layer's, whose indexer
    keys are scored). The scores are one op reading the FP8 key cache in place (a Triton kernel
    on a GPU); in an extend, one per request of the piece, its keys read once for all its
    queries."""
    q = indexer.project_q(qr, freqs_cis, positions, options.reference, options.kernel)
    w = indexer.head_weights(x, options.reference, options.kernel)
    loc, visible = plan.candidates(rows)
    if plan.row_request is None:
        scores = indexer_scores(q, w, caches.index, loc, visible, caches.index_page_size,
                                weight_scale=indexer.weight_scale,
                                key_tile=caches.index_key_tile, kernel=options.kernel)
    else:   # an extend: the queries of a request share its candidates, each key read once
        scores = torch.cat([
            indexer_scores_shared(q[run], w[run], caches.index, plan.row_loc[request],
                                  visible[run], caches.index_page_size,
                                  weight_scale=indexer.weight_scale,
                                  key_tile=caches.index_key_tile, kernel=options.kernel)
            for run, request in plan.request_runs(rows)])
    pick = indexer.select(scores, visible, options, plan.row_width[rows])
    return picked_rows(loc, pick, kernel=options.kernel)


def read_kv_shared(cache: torch.Tensor, loc: torch.Tensor, page_size: int,
                   dialect: Fp8Dialect) -> torch.Tensor:
    """read_kv_rows for an extend, where the queries of a request share most of their rows: each
    distinct row is dequantized once (torch.unique: a host sync, so not for graphs)."""
    distinct, inverse = torch.unique(loc, return_inverse=True)
    return kv_layout.read_kv_rows(cache, distinct, page_size, dialect)[inverse]


def attend(attn: Attention, q: torch.Tensor, qr: torch.Tensor, x: torch.Tensor,
           freqs_cis: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
           options: Options, caches, decode: bool) -> torch.Tensor:
    """Attention output [N, dim] of queries q [N, H, 512] (normed, rotated) at positions [N] (the
    ops read the RoPE table freqs_cis at them); caches is the layer's ``LayerCaches``. Decode:
    one op reading the FP8 rows in place (``hip_kernels.sparse_decode_attention``, a Triton
    kernel on a GPU). Extend: each distinct row is dequantized once for all the queries of a
    piece (``extend_piece``), then the same math."""
    n = q.shape[0]
    plan = meta.plans[attn.ratio] if attn.ratio else None
    piece = n if decode else min(n, layer_extend_piece(attn, meta.window_loc.shape[1], plan))
    outs = []
    for start in range(0, n, max(piece, 1)):
        rows = slice(start, min(n, start + piece))
        window = (meta.window_loc[rows], meta.window_valid[rows])
        comp = None
        if plan is not None:
            if attn.indexer is not None:
                comp = select_rows(attn.indexer, qr[rows], x[rows], freqs_cis, positions[rows],
                                   plan, rows, caches, options)
            else:
                comp = plan.candidates(rows)
        if decode:
            o = sparse_decode_attention(
                q[rows], caches.swa, *window, caches.swa_page_size,
                caches.compressed if comp else None, *(comp or (None, None)),
                caches.compressed_page_size, attn.attn_sink, attn.softmax_scale,
                options.reference, kernel=options.kernel)
        else:
            dialect = options.kernel.fp8_dialect
            kv = [read_kv_shared(caches.swa, window[0], caches.swa_page_size, dialect)]
            valid = [window[1]]
            if comp:
                kv.append(read_kv_shared(caches.compressed, comp[0], caches.compressed_page_size,
                                         dialect))
                valid.append(comp[1])
            width = None if meta.window_width is None else meta.window_width[rows]
            o = attn.sparse_attention(q[rows], kv, valid, options.reference, width)
        outs.append(attn.project_out(o, freqs_cis, positions[rows], options.kernel))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def store_compressed(caches, kernel: KernelOptions):
    return lambda rows, loc: set_kv.fused_store_cache(rows, caches.compressed, loc,
                                                      caches.compressed_page_size,
                                                      kernel=kernel)


def store_index_keys(caches, kernel: KernelOptions):
    """The indexer keys' store: ``set_kv.indexer_store`` with a power-of-two scale per row
    (2^ceil(log2(amax / FP8_MAX))), so the FP4-simulated keys (e2m1 values times a power of
    two: fp8 values) read back exactly, in the pool's key order. One dispatcher op; rows with
    loc < 0 write nothing."""
    return lambda rows, loc: set_kv.indexer_store(rows, caches.index, loc, caches.index_page_size,
                                                  pow2_scale=True, key_tile=caches.index_key_tile,
                                                  kernel=kernel)


class PagedAttention:
    """One decoder layer's attention over a ``mem_pool`` pool (a plain object beside the layer's
    ``Attention`` module, whose parameters it uses: the checkpoint names stay the module's).

    ``__call__`` runs the whole attention half of a step: prepare (Q projection; the window KV
    row normed, rotated and stored at ``meta.swa_write_loc``, fused with q's norm and RoPE; the
    compressors; on side streams with ``options.multi_stream_prepare``), then ``attend``.
    The layer's ``LayerCaches`` are made when it first sees a pool and kept while it is that
    pool (a pool allocates its buffers once)."""

    def __init__(self, attn: Attention):
        self.attn = attn
        self.layer_id = attn.layer_id
        self.ratio = attn.ratio
        self._bound = None                   # (weakref to a pool, LayerCaches)
        self._streams = None

    def caches(self, pool) -> LayerCaches:
        bound = self._bound
        if bound is None or bound[0]() is not pool:
            bound = (weakref.ref(pool), LayerCaches.of(pool, self.layer_id, self.ratio))
            self._bound = bound
        return bound[1]

    def __call__(self, y: torch.Tensor, batch, meta: AttentionMetadata, options: Options, pool,
                 freqs_cis: torch.Tensor, ring_capture: RingRowCapture | None = None
                 ) -> torch.Tensor:
        """Attention output [N, dim] of the normed hidden states y [N, dim], computed with the
        step's options; freqs_cis: the layer's RoPE table; ring_capture: where the ratio-4 ring
        rows it asks for go."""
        caches = self.caches(pool)
        prepare = self.prepare_multi_stream if options.multi_stream_prepare else self.prepare
        q, qr = prepare(y, batch, meta, options, pool, caches, freqs_cis, ring_capture)
        return attend(self.attn, q, qr, y, freqs_cis, batch.positions, meta, options, caches,
                      batch.is_decode)

    def project_q_store_kv(self, y, batch, meta, options, pool, caches, freqs_cis):
        """(q, qr): Q projection; window KV norm + RoPE + FP8 store into the layer's SWA buffer
        at the step's SWA write slots (or, when the metadata has none, at out_cache_loc
        translated inside the store kernel through the pool's mapping), fused with q's
        weightless norm + RoPE (in place)."""
        kernel = options.kernel
        q, qr = self.attn.project_q(y, kernel)
        kv = self.attn.project_kv(y, kernel)
        args = (kv, self.attn.kv_norm.weight, self.attn.eps, freqs_cis, batch.positions)
        numerics = options.store_numerics
        if meta.swa_write_loc is None:
            set_kv.fused_translate_norm_rope_store(
                *args, batch.out_cache_loc, pool.registered_mapping(), caches.swa,
                caches.swa_page_size, q=q, numerics=numerics, kernel=kernel)
        else:
            set_kv.fused_k_norm_rope_store(*args, meta.swa_write_loc, caches.swa,
                                           caches.swa_page_size, q=q, numerics=numerics,
                                           kernel=kernel)
        return q, qr

    def prepare(self, y, batch, meta, options, pool, caches, freqs_cis, ring_capture=None):
        """Everything on the current stream: Q, window KV store, compressors. (q, qr)."""
        q, qr = self.project_q_store_kv(y, batch, meta, options, pool, caches, freqs_cis)
        if self.ratio:
            self._run_compressor(y, meta, options, caches, freqs_cis, ring_capture)
        if self.attn.indexer is not None:
            self._run_indexer_compressor(y, meta, options, caches, freqs_cis, ring_capture)
        return q, qr

    def prepare_multi_stream(self, y, batch, meta, options, pool, caches, freqs_cis,
                             ring_capture=None):
        """The compressors on side streams, Q/KV and the window store on the main stream, joined
        before the indexer scoring and the attention. Same results as ``prepare``."""
        main = streams.current_stream(y.device)
        side = self._side_streams(y.device)
        for s in side:
            s.wait_stream(main)                       # y is ready
        if self.ratio:
            with streams.on_stream(side[0]):
                self._run_compressor(y, meta, options, caches, freqs_cis, ring_capture)
        if self.attn.indexer is not None:
            with streams.on_stream(side[1]):
                self._run_indexer_compressor(y, meta, options, caches, freqs_cis, ring_capture)
        q, qr = self.project_q_store_kv(y, batch, meta, options, pool, caches, freqs_cis)
        for s in side:
            main.wait_stream(s)
        return q, qr

    def _side_streams(self, device):
        if self._streams is None:
            self._streams = (streams.new_stream(device), streams.new_stream(device))
        return self._streams

    def _run_compressor(self, y, meta, options, caches, freqs_cis, ring_capture):
        new = run_compressor(self.attn.compressor, y, meta.plans[self.ratio],
                             caches.state, store_compressed(caches, options.kernel),
                             freqs_cis, options.reference, options.kernel)
        if self.ratio == 4 and ring_capture is not None:
            ring_capture.keep("compressor_state", self.layer_id, new)

    def _run_indexer_compressor(self, y, meta, options, caches, freqs_cis, ring_capture):
        new = run_compressor(self.attn.indexer.compressor, y, meta.plans[4],
                             caches.index_state, store_index_keys(caches, options.kernel),
                             freqs_cis, options.reference, options.kernel)
        if ring_capture is not None:
            ring_capture.keep("indexer_compressor_state", self.layer_id, new)
