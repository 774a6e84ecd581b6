"""How much memory a model run needs, before anything is allocated, and how much the device has.

The weights are counted on torch's meta device (the model is built there: shapes, no storage), in
the format the model holds them: ``weights="native"``, the published formats (FP8 linears with
their 128x128 block scales, FP4 routed experts with their 1x32 scales, ``weights.formats``), or
``weights="bf16"``, every quantized weight dequantized to bf16; what the reference keeps in
bf16/fp32 counts as such either way. The KV pool comes from `mem_pool.footprint` for `batch`
requests of `context_len` tokens.

A prompt is prefilled in chunks of at most ``prefill_chunk`` tokens (the engine's extend steps).
What one such step allocates beside the weights and the pool (`prefill_bytes`) has three parts,
each bounded by what the code holds at once:

- per token of the chunk (`token_bytes`): the compressors' pooled windows (each window-closing
  token gathers its ring's rows, kv and score in fp32, a few copies alive), the query in bf16,
  the hidden copies and the routed experts' activations;
- per request (`table_bytes`): the compressed-row tables, an int64 location and a flag per
  compressed row of its context and the int64 temporaries they are built from, and its logits;
- one piece of attention (`piece_bytes`): an extend attends its queries in pieces whose size
  ``paged_attention.extend_piece`` caps by the candidates the indexer scores and the rows the
  attention dequantizes, so a piece holds at most a fixed number of (query, row) pairs.

Nothing in it is sized by the chunk times the context: the share grows with the chunk, and with
the context only through one location per compressed row. The coefficients are counted from the
code and checked against the allocations the CPU engine makes
(tests/runtime/test_prefill_memory.py): the estimate is an upper bound within a small factor.

``auto_prefill_chunk`` sizes the chunk when the user does not: the largest power of two between
one page and ``MAX_AUTO_CHUNK`` tokens whose prefill share fits in what the device has left after
the weights, the KV pool and a margin of ``MARGIN_FRACTION`` of the device's memory (one page
when even that does not fit: the run's own fit check then says so).

With tensor parallelism over ``tp`` ranks the estimate is one rank's: its part of the weights (the
split of ``dsv4.parallel``: its heads, output groups, routed experts and vocab rows, and every
replicated tensor whole), and the whole KV pool (the latent KV row serves every head).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hip_kernels.indexer_scores import KEY_TILE_COLUMNS
from mem_pool.kv_cache_spec import STATE_RING, KVCacheSpec, footprint

from .paged_attention import extend_piece
from .weights.formats import native_bytes

GIB = 2 ** 30
# Bytes per (request, compressed row) of an extend's row tables: the int64 location and bool
# flag kept, and the int64 temporaries alive while they are built.
TABLE_BYTES_PER_ROW = 32
# fp32 copies of a compressor's gathered windows alive at once (rows from the step and from the
# ring, then the choice between them), and of a piece's dequantized attention rows (gathered,
# ordered, padded, masked) and of its scores.
POOLED_COPIES = 4
ROW_COPIES = 5
SCORE_COPIES = 5
# Bytes per (query, indexer candidate) of a piece: location, visibility, score, top-k's keys.
CANDIDATE_BYTES = 32
KV_DIM = 512            # a KV row's width (head_dim): what attention dequantizes, fp32
INDEX_DIM = 128         # an indexer key's width
WEIGHT_FORMATS = ("native", "bf16")
MAX_AUTO_CHUNK = 4096   # the largest chunk auto_prefill_chunk picks (tokens)
MARGIN_FRACTION = 0.05  # of the device's memory, kept free by auto_prefill_chunk


@dataclass(frozen=True)
class MemoryEstimate:
    weight_bytes: int
    kv_bytes: int
    prefill_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.prefill_bytes

    def describe(self) -> str:
        return (f"{self.total_bytes / GIB:.1f} GiB ({self.weight_bytes / GIB:.1f} GiB of weights, "
                f"{self.kv_bytes / GIB:.2f} GiB of KV cache, {self.prefill_bytes / GIB:.2f} GiB "
                "for the prefill step)")


def _ratios(config) -> set[int]:
    return {r for r in config.compress_ratios[:config.n_layers] if r}


def token_bytes(config, tp: int = 1) -> int:
    """Bytes an extend step holds per token of its chunk, on one of ``tp`` ranks."""
    c = config
    pooled = 0
    for ratio in _ratios(c):
        coff = 2 if ratio == 4 else 1          # ratio 4 pools overlapping windows [A | B]
        dims = [c.head_dim] + ([c.index_head_dim] if ratio == 4 else [])
        for d in dims:                         # the attention's compressor, the indexer's
            row = 2 * coff * d * 4             # (kv, score) fp32
            pooled = max(pooled, row + POOLED_COPIES * STATE_RING[ratio] * row // ratio)
    query = 2 * (c.n_heads // tp) * c.head_dim
    hidden = 4 * c.hc_mult * c.dim
    experts = 3 * 4 * (c.n_activated_experts + c.n_shared_experts) * c.moe_inter_dim
    return pooled + query + hidden + experts


def table_bytes(config, context_len: int) -> int:
    """Bytes an extend step holds per request of up to ``context_len`` tokens."""
    rows = sum(context_len // r for r in _ratios(config))
    return rows * TABLE_BYTES_PER_ROW + 2 * 4 * config.vocab_size


def piece_bytes(config, context_len: int, tp: int = 1) -> int:
    """Bytes one piece of an extend's attention holds, the largest over the model's layers."""
    c = config
    w, heads = c.window_size, c.n_heads // tp
    pair = KV_DIM * 4 * ROW_COPIES + heads * 4 * SCORE_COPIES       # per (query, row)
    most = extend_piece(w, 0, 0) * w * pair                          # a window-only layer
    for ratio in _ratios(c):
        rows = context_len // ratio
        if ratio != 4:                                               # every row attended
            most = max(most, extend_piece(w, 0, rows) * (w + rows) * pair)
            continue
        kept = min(c.index_topk, rows)
        n = extend_piece(w, rows, kept)
        index_heads = c.index_n_heads // tp
        tile = min(KEY_TILE_COLUMNS, rows)
        keys = n * tile * (INDEX_DIM * (4 + 2) + index_heads * 4 * 2)
        most = max(most, n * (w + kept) * pair + n * rows * CANDIDATE_BYTES + keys)
    return most


def prefill_bytes(config, chunk: int, context_len: int, batch: int = 1, tp: int = 1) -> int:
    """Working memory of one extend step over ``chunk`` tokens of ``batch`` requests of up to
    context_len tokens, on one of ``tp`` ranks (see the module docstring); 0 without tokens."""
    if chunk <= 0:
        return 0
    return (chunk * token_bytes(config, tp) + min(batch, chunk) * table_bytes(config, context_len)
            + piece_bytes(config, context_len, tp))


def auto_prefill_chunk(config, context_len: int, device_bytes: int, weight_and_kv_bytes: int,
                       page_size: int = 256, batch: int = 1, tp: int = 1) -> int:
    """The prefill chunk (tokens) a device of device_bytes holding weight_and_kv_bytes of
    weights and KV pool can take: the largest power of two c, page_size <= c <=
    MAX_AUTO_CHUNK, with prefill_bytes(config, c, context_len, batch, tp) <= device_bytes *
    (1 - MARGIN_FRACTION) - weight_and_kv_bytes (batch: the requests a step may hold; tp: the
    ranks, the estimate being one rank's); page_size when none fits."""
    spare = device_bytes * (1 - MARGIN_FRACTION) - weight_and_kv_bytes
    chunk = MAX_AUTO_CHUNK
    while chunk > page_size and prefill_bytes(config, chunk, context_len, batch, tp) > spare:
        chunk //= 2
    return max(chunk, page_size)


def weight_bytes(config, weights: str = "native", max_seq_len: int = 4096, tp: int = 1) -> int:
    """Bytes of the model's parameters and buffers, its weights held as ``weights`` says; with
    ``tp`` > 1, of one tensor-parallel rank's part."""
    from .model import DeepseekV4Model
    from .parallel import TensorSplit

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    model = DeepseekV4Model(config, device="meta", max_seq_len=max_seq_len, weights="bf16",
                            split=TensorSplit(0, tp))
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if weights == "bf16":
        return sum(t.numel() * t.element_size() for _, t in tensors)
    return sum(native_bytes(name, tuple(t.shape), t.element_size()) for name, t in tensors)


def estimate(config, batch: int, context_len: int, page_size: int = 256,
             prefill_tokens: int = 0, weights: str = "native", tp: int = 1) -> MemoryEstimate:
    """Bytes a run of ``batch`` requests of up to ``context_len`` tokens needs, with prefill
    steps of up to ``prefill_tokens`` tokens (the chunk, or all the prompt tokens when they are
    fewer), the weights held as ``weights`` ("native" or "bf16"); on each rank of ``tp``."""
    spec = KVCacheSpec(compress_ratios=config.compress_ratios[:config.n_layers],
                       window_size=config.window_size)
    tokens = batch * -(-context_len // page_size) * page_size
    kv = footprint(spec, page_size).total_bytes(tokens, tokens, batch + 1)
    return MemoryEstimate(weight_bytes(config, weights, context_len, tp), kv,
                          prefill_bytes(config, prefill_tokens, context_len, batch, tp))


def shortfall(need: MemoryEstimate, have_bytes: int, where: str) -> str | None:
    """What to tell a user whose run needs ``need`` on ``where`` (holding ``have_bytes``), or
    None when it fits."""
    if need.total_bytes <= have_bytes:
        return None
    return (f"this run needs about {need.describe()} but {where} has {have_bytes / GIB:.1f} GiB; "
            "use a smaller model, shorter or fewer prompts, a smaller --prefill-chunk, or pass "
            "--force")


def available_bytes(device: torch.device) -> int:
    """Total memory of the GPU, or the machine's physical memory for a CPU run."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
