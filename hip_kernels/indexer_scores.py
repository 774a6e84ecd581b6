"""The lightning indexer's scores of a query against compressed rows read from the FP8 indexer
cache, as one dispatcher op (`torch.ops.dsv4.indexer_scores`).

    score[n, t] = sum_h relu(q[n, h] . key[n, t]) * w[n, h],   w = weights * weight_scale

in the dtype of the weights: bf16 is the reference numerics (each step rounded to bf16: the
scaled weights, the q.k products, relu, the weighting, the head sum), fp32 keeps every step
fp32. The weight scale (the model's 128^-0.5 * Hi^-0.5) is applied inside the op as torch
multiplies a tensor by a Python float: the product in fp32, rounded to the weights' dtype. The
keys are the cache's rows at loc (fp8 values times their fp32 scale, see
`kv_layout.read_indexer_rows`; `key_tile` names the order of the values in a page,
`kv_layout.INDEX_KEY_TILES`: 0 row-major, 16 keys in 16 x 16 tiles). Rows that are not valid
score -inf, so a top-k can take the scores as they are.

The torch path (`indexer_scores_cache_ref`) dequantizes every row into an fp32 [N, C, 128]
copy and runs the reference (`indexer_scores_ref`); the Triton kernel (`indexer_scores_triton`)
reads the cache bytes in place. In fp32 they agree to fp32 rounding (different summation
orders). In bf16 the kernel sums the 128 exact products of each q.k in fp32 in another order
than torch's CPU bf16 matmul, so a q.k near a bf16 rounding boundary can round the other way;
the score then differs by about one bf16 ulp of that head's term (the tests allow one ulp of
the score plus two of the largest term, on at most 1% of entries). In practice such flips are
rare: every entry tested was bit-equal.
"""

from __future__ import annotations

import torch

from . import kv_layout
from .backend import resolve
from .checks import (check_cache, check_kernel, check_page_size, check_tensor,
                     value_checks_enabled)
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from .platform import DIALECTS

OP = "indexer_scores"
SHARED_OP = "indexer_scores_shared"
Q_DTYPES = (torch.float32, torch.bfloat16)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
# Columns of keys the torch backend dequantizes at once. A multiple of 64: CPU GEMMs block their
# columns by 64, so a score comes out with the same bits in a tile as in the whole row (fp32 and
# bf16; tests/kernels/test_indexer_scores.py checks it).
KEY_TILE_COLUMNS = 512


def indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor,
                       keys: torch.Tensor) -> torch.Tensor:
    """q [N, Hi, 128], weights [N, Hi], keys [N, T, 128] -> scores [N, T] in weights' dtype
    (every step rounded to it: q.k, relu, the weighting, the sum over heads)."""
    dtype = weights.dtype
    s = torch.einsum("nhd,ntd->nht", q.to(dtype), keys.to(dtype)).relu()
    return (s * weights.unsqueeze(-1)).sum(1)


def indexer_scores_cache_ref(q, weights, cache, loc, valid, page_size, weight_scale, dialect,
                             key_tile):
    """The op's torch backend: the keys at loc dequantized (dialect: the fp8 dialect's name),
    scored by `indexer_scores_ref` with the weights times weight_scale, -inf where not valid;
    ``KEY_TILE_COLUMNS`` columns at a time, so the dequantized keys never outgrow one tile."""
    weights = weights * weight_scale
    tiles = []
    for start in range(0, loc.shape[1], KEY_TILE_COLUMNS):
        cols = slice(start, start + KEY_TILE_COLUMNS)
        keys = kv_layout.read_indexer_rows(cache, loc[:, cols], page_size, DIALECTS[dialect],
                                           key_tile)
        tiles.append(indexer_scores_ref(q, weights, keys))
    scores = torch.cat(tiles, 1) if tiles else weights.new_empty(loc.shape)
    return scores.masked_fill(~valid, float("-inf"))


def _fake(q, weights, cache, loc, valid, page_size, weight_scale, dialect, key_tile):
    return weights.new_empty(loc.shape)


def indexer_scores_shared_ref(q, weights, cache, loc, valid, page_size, weight_scale, dialect,
                              key_tile):
    """The shared op's torch backend: each tile of keys at loc [C] dequantized once for all the
    queries, scored as `indexer_scores_ref` scores them with the weights times weight_scale (the
    same bits: one q.k per entry, the same reductions), -inf where not valid."""
    weights = weights * weight_scale
    dtype = weights.dtype
    tiles = []
    for start in range(0, loc.shape[0], KEY_TILE_COLUMNS):
        keys = kv_layout.read_indexer_rows(cache, loc[start:start + KEY_TILE_COLUMNS],
                                           page_size, DIALECTS[dialect], key_tile)
        s = torch.einsum("nhd,td->nht", q.to(dtype), keys.to(dtype)).relu()
        tiles.append((s * weights.unsqueeze(-1)).sum(1))
    scores = torch.cat(tiles, 1) if tiles else weights.new_empty(valid.shape)
    return scores.masked_fill(~valid, float("-inf"))


def _shared_fake(q, weights, cache, loc, valid, page_size, weight_scale, dialect, key_tile):
    return weights.new_empty(valid.shape)


define_op(OP, "(Tensor q, Tensor weights, Tensor cache, Tensor loc, Tensor valid, "
          "int page_size, float weight_scale, str dialect, int key_tile) -> Tensor",
          indexer_scores_cache_ref, _fake, triton="indexer_scores_triton.indexer_scores_triton")
define_op(SHARED_OP, "(Tensor q, Tensor weights, Tensor cache, Tensor loc, Tensor valid, "
          "int page_size, float weight_scale, str dialect, int key_tile) -> Tensor",
          indexer_scores_shared_ref, _shared_fake,
          triton="indexer_scores_triton.indexer_scores_shared_triton")


def _check_args(q, weights, cache, loc, valid, page_size, weight_scale, key_tile, kernel,
                shared=False) -> None:
    check_tensor("q", q, dtypes=Q_DTYPES, shape=(None, None, kv_layout.INDEX_DIM))
    if isinstance(weight_scale, bool) or not isinstance(weight_scale, (int, float)):
        raise TypeError(f"weight_scale must be a float, got {weight_scale!r}")
    n, heads = q.shape[:2]
    dev = q.device
    check_tensor("weights", weights, dtypes=WEIGHT_DTYPES, shape=(n, heads), device=dev)
    check_page_size(page_size)
    kv_layout.check_key_tile(key_tile, page_size)
    check_cache("cache", cache, kv_layout.indexer_page_bytes(page_size), page_size, dev)
    check_tensor("loc", loc, dtypes=(torch.int64, torch.int32),
                 shape=(None,) if shared else (n, None), device=dev)
    check_tensor("valid", valid, dtype=torch.bool,
                 shape=(n, loc.shape[0]) if shared else tuple(loc.shape), device=dev)
    if loc.numel() and value_checks_enabled(kernel):
        capacity = cache.shape[0] * page_size
        lo, hi = torch.stack(torch.where(valid, loc, 0).aminmax()).tolist()
        if lo < 0 or hi >= capacity:
            raise IndexError(f"loc holds location {lo if lo < 0 else hi} at a valid row but the "
                             f"cache has {capacity} slots (0..{capacity - 1})")


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor,
                   valid: torch.Tensor, page_size: int, *, weight_scale: float = 1.0,
                   key_tile: int = 0,
                   kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """Scores [N, C] in weights' dtype of queries q [N, Hi, 128] (fp32 or bf16) with per-head
    weights [N, Hi] (bf16: reference numerics; fp32: fp32 numerics) times weight_scale (a float,
    applied inside the op: the product rounded to the weights' dtype) against the indexer keys
    at loc [N, C] (int64 or int32) of cache (uint8 [pages, indexer_page_bytes(page_size)], its
    keys in key_tile's order: 0 row-major, 16 in 16 x 16 tiles).
    Entries where valid (bool [N, C]) is False score -inf; their loc is never read (0 by
    convention).

    The valid locations are range-checked on the host (one read) unless value checks are off
    (inside graph capture, `trusted_locations()`, kernel.value_checks False); the Triton
    kernel then scores a valid location outside the cache NaN, never reading past it. The
    backend: kernel.backend (no HIP version: hip runs Triton where it can)."""
    check_kernel(kernel)
    _check_args(q, weights, cache, loc, valid, page_size, weight_scale, key_tile, kernel)
    return op(OP, resolve(OP, q.device, kernel.backend))(
        q.contiguous(), weights.contiguous(), cache, loc.contiguous(), valid.contiguous(),
        page_size, float(weight_scale), kernel.fp8_dialect.name, key_tile)


def indexer_scores_shared(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                          loc: torch.Tensor, valid: torch.Tensor, page_size: int, *,
                          weight_scale: float = 1.0, key_tile: int = 0,
                          kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """`indexer_scores` for queries that share one list of candidate rows, loc [C] (int64 or
    int32): an extend's queries of one request, each seeing the rows its position has closed
    (valid [N, C]). The scores are those `indexer_scores` gives with loc repeated for every
    query, bit for bit; the torch path dequantizes each key once for all of them instead of
    once per query. Same checks and backends as `indexer_scores`."""
    check_kernel(kernel)
    _check_args(q, weights, cache, loc, valid, page_size, weight_scale, key_tile, kernel,
                shared=True)
    return op(SHARED_OP, resolve(OP, q.device, kernel.backend))(
        q.contiguous(), weights.contiguous(), cache, loc.contiguous(), valid.contiguous(),
        page_size, float(weight_scale), kernel.fp8_dialect.name, key_tile)
