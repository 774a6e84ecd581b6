"""The DeepSeek-V4 paged FP8 KV layout (SWA, C4 and C128 caches) and the indexer layout.

One token of a KV row takes 584 bytes: 448 fp8 "nope" values, 64 bf16 RoPE values (128 bytes),
7 ue8m0 scale bytes (one per 64-wide tile of the nope part) and one pad byte. A page of P tokens:

    [0, P*576)             token t's 576 value bytes at t*576 (448 fp8, then 64 bf16 little-endian)
    [P*576, P*584)         token t's 8 scale bytes at P*576 + t*8 (7 ue8m0 + 1 pad)
    [P*584, page_bytes(P)) zero padding: the page stride is a multiple of 576

Indexer cache: 132 bytes per token, page = [P*128 fp8 values][P*4 fp32 scales].

The functions here are the torch reference (the CPU path and every kernel's test oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .platform import Fp8Dialect, fp8_dialect

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
TILE = 64
N_TILES = NOPE_DIM // TILE            # 7
VALUE_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = 8                        # 7 ue8m0 + 1 pad
TOKEN_BYTES = VALUE_BYTES + SCALE_BYTES  # 584
AMAX_FLOOR = 1e-4
UE8M0_BIAS = 127

INDEX_DIM = 128
INDEX_TOKEN_BYTES = INDEX_DIM + 4      # 132


@dataclass(frozen=True)
class StoreNumerics:
    """How a KV row is computed before it lands in the layout. The byte layout never changes;
    these are the points where writers of the same layout are known to differ, as explicit
    parameters of the set-KV ops (the default is this project's, which follows the reference
    inference code):

    - round_to_bf16: the RMSNorm output is rounded to bf16 before RoPE and quantization (the
      reference). False keeps it fp32 through the norm and the RoPE, and quantizes the fp32
      values (the RoPE dims are still stored as bf16).
    - fp8_max: the clamp and the scale divisor of the fp8 cast; None = the dialect's largest
      finite value (240 fnuz, 448 OCP). Some writers use 224 with fnuz.
    - amax_floor: the smallest tile amax used for a scale (1e-4; some writers use 1e-8).
    - q_rope_only: with a fused q, only RoPE its last 64 dims of every head (no RMSNorm), and
      round each rotated pair as `fma(x, cos, round(-y*sin))`, `fma(y, cos, round(x*sin))`.
    """

    round_to_bf16: bool = True
    fp8_max: float | None = None
    amax_floor: float = AMAX_FLOOR
    q_rope_only: bool = False

    def __post_init__(self):
        if self.fp8_max is not None and not 0 < self.fp8_max <= 448:
            raise ValueError(f"StoreNumerics.fp8_max must be in (0, 448] or None, got {self.fp8_max}")
        if not self.amax_floor > 0:
            raise ValueError(f"StoreNumerics.amax_floor must be > 0, got {self.amax_floor}")

    def fp8_max_for(self, dialect: Fp8Dialect) -> float:
        """The clamp used with `dialect`: fp8_max, never above the dialect's own maximum."""
        if self.fp8_max is None:
            return dialect.max
        if self.fp8_max > dialect.max:
            raise ValueError(f"StoreNumerics.fp8_max={self.fp8_max} exceeds the {dialect.name} "
                             f"fp8 maximum {dialect.max}")
        return self.fp8_max

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_NUMERICS


DEFAULT_NUMERICS = StoreNumerics()


def page_bytes(page_size: int) -> int:
    """Byte stride of one SWA/C4/C128 page: ceil(page_size*584/576)*576."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return -(-page_size * TOKEN_BYTES // VALUE_BYTES) * VALUE_BYTES


def indexer_page_bytes(page_size: int) -> int:
    """Byte stride of one indexer page: page_size * 132."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return page_size * INDEX_TOKEN_BYTES


def value_offset(loc: torch.Tensor, page_size: int) -> torch.Tensor:
    """int64 byte offset of each location's value bytes in a flattened cache."""
    loc = loc.to(torch.int64)
    return (loc // page_size) * page_bytes(page_size) + (loc % page_size) * VALUE_BYTES


def scale_offset(loc: torch.Tensor, page_size: int) -> torch.Tensor:
    """int64 byte offset of each location's 8 scale bytes in a flattened cache."""
    loc = loc.to(torch.int64)
    return ((loc // page_size) * page_bytes(page_size) + page_size * VALUE_BYTES
            + (loc % page_size) * SCALE_BYTES)


def pow2_ceil_exponent(r: torch.Tensor) -> torch.Tensor:
    """ceil(log2(r)) for positive normal fp32 r, exactly, from the bits (no log2 rounding)."""
    bits = r.to(torch.float32).view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    return exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def quantize_kv_rows(x: torch.Tensor, dialect: Fp8Dialect | None = None,
                     numerics: StoreNumerics = DEFAULT_NUMERICS):
    """Quantize KV rows [N, 512] the way the cache stores them.

    The row is rounded to bf16 first (as the reference does; `numerics.round_to_bf16=False`
    quantizes the fp32 values). Each 64-wide tile of the nope part gets a power-of-two scale
    2^ceil(log2(max(amax, amax_floor) / FP8_MAX)); values are x / scale clamped to +-FP8_MAX and
    cast (round to nearest even). Returns
    (nope [N, 448] fp8, rope [N, 64] bf16, scales [N, 7] uint8 ue8m0 = exponent + 127).
    """
    if x.dim() != 2 or x.shape[1] != HEAD_DIM:
        raise ValueError(f"x must be [N, {HEAD_DIM}], got {tuple(x.shape)}")
    d = dialect or fp8_dialect()
    fp8_max = numerics.fp8_max_for(d)
    xq = x.to(torch.bfloat16) if numerics.round_to_bf16 else x
    tiles = xq[:, :NOPE_DIM].float().view(-1, N_TILES, TILE)
    amax = tiles.abs().amax(dim=-1).clamp_min(numerics.amax_floor)
    exp = pow2_ceil_exponent(amax / fp8_max)
    inv_scale = torch.ldexp(torch.ones_like(amax), -exp)
    q = (tiles * inv_scale.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(d.torch_dtype)
    scales = (exp + UE8M0_BIAS).to(torch.uint8)
    return q.view(-1, NOPE_DIM), x[:, NOPE_DIM:].to(torch.bfloat16).contiguous(), scales


def dequantize_kv_rows(nope: torch.Tensor, rope: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_kv_rows: float32 [N, 512]."""
    exp = scales.to(torch.int32) - UE8M0_BIAS
    scale = torch.ldexp(torch.ones(exp.shape, dtype=torch.float32, device=exp.device), exp)
    vals = nope.float().view(-1, N_TILES, TILE) * scale.unsqueeze(-1)
    return torch.cat([vals.view(-1, NOPE_DIM), rope.float()], dim=1)


def pack_kv_bytes(nope: torch.Tensor, rope: torch.Tensor, scales: torch.Tensor):
    """(value bytes [N, 576], scale bytes [N, 8]) exactly as they sit in the cache."""
    n = nope.shape[0]
    values = torch.cat([nope.contiguous().view(torch.uint8),
                        rope.to(torch.bfloat16).contiguous().view(torch.uint8).view(n, 2 * ROPE_DIM)], 1)
    scale_bytes = torch.zeros(n, SCALE_BYTES, dtype=torch.uint8, device=scales.device)
    scale_bytes[:, :N_TILES] = scales
    return values, scale_bytes


def _byte_index(offsets: torch.Tensor, width: int) -> torch.Tensor:
    return offsets.unsqueeze(1) + torch.arange(width, device=offsets.device, dtype=torch.int64)


def scatter_bytes(flat: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor,
                  keep: torch.Tensor) -> None:
    """flat[idx[i]] = rows[i] for rows where keep[i], with shapes that never depend on the data
    (so it can be graph-captured): skipped rows target byte 0 and add a zero delta, and the
    write is an accumulate of (new - old) mod 256, which duplicates of a skipped row cannot
    disturb."""
    keep = keep.unsqueeze(1)
    idx = torch.where(keep, idx, torch.zeros_like(idx))
    delta = torch.where(keep, rows - flat[idx], torch.zeros_like(rows))
    flat.index_put_((idx.flatten(),), delta.flatten(), accumulate=True)


def write_kv_bytes(cache: torch.Tensor, loc: torch.Tensor, page_size: int,
                   values: torch.Tensor, scale_bytes: torch.Tensor) -> None:
    """Scatter packed rows into the cache at loc; rows with loc < 0 are skipped."""
    keep = loc >= 0
    safe = loc.clamp_min(0)
    flat = cache.view(-1)
    scatter_bytes(flat, _byte_index(value_offset(safe, page_size), VALUE_BYTES), values, keep)
    scatter_bytes(flat, _byte_index(scale_offset(safe, page_size), SCALE_BYTES), scale_bytes, keep)


def read_kv_bytes(cache: torch.Tensor, loc: torch.Tensor, page_size: int):
    """(value bytes [N, 576], scale bytes [N, 8]) of the rows at loc (all loc must be >= 0)."""
    flat = cache.view(-1)
    values = flat[_byte_index(value_offset(loc, page_size), VALUE_BYTES)]
    scale_bytes = flat[_byte_index(scale_offset(loc, page_size), SCALE_BYTES)]
    return values, scale_bytes


def read_kv_rows(cache: torch.Tensor, loc: torch.Tensor, page_size: int,
                 dialect: Fp8Dialect | None = None) -> torch.Tensor:
    """Dequantized rows [N, 512] float32 read from a V4-layout cache at loc."""
    d = dialect or fp8_dialect()
    values, scale_bytes = read_kv_bytes(cache, loc, page_size)
    n = values.shape[0]
    nope = values[:, :NOPE_DIM].contiguous().view(d.torch_dtype)
    rope = values[:, NOPE_DIM:].contiguous().view(torch.bfloat16).view(n, ROPE_DIM)
    return dequantize_kv_rows(nope, rope, scale_bytes[:, :N_TILES])


def quantize_indexer_rows(k: torch.Tensor, dialect: Fp8Dialect | None = None):
    """Indexer keys [N, 128] -> (fp8 [N, 128], fp32 scale [N]); scale = max(amax, 1e-4) / FP8_MAX."""
    if k.dim() != 2 or k.shape[1] != INDEX_DIM:
        raise ValueError(f"k must be [N, {INDEX_DIM}], got {tuple(k.shape)}")
    d = dialect or fp8_dialect()
    kf = k.float()
    scale = kf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / d.max
    q = (kf / scale.unsqueeze(-1)).clamp(-d.max, d.max).to(d.torch_dtype)
    return q, scale


def write_indexer_bytes(cache: torch.Tensor, loc: torch.Tensor, page_size: int,
                        q: torch.Tensor, scale: torch.Tensor) -> None:
    """Scatter quantized indexer rows into the 132-byte layout; rows with loc < 0 are skipped."""
    keep = loc >= 0
    safe = loc.clamp_min(0).to(torch.int64)
    base = (safe // page_size) * indexer_page_bytes(page_size)
    t = safe % page_size
    flat = cache.view(-1)
    scatter_bytes(flat, _byte_index(base + t * INDEX_DIM, INDEX_DIM),
                  q.contiguous().view(torch.uint8), keep)
    scatter_bytes(flat, _byte_index(base + page_size * INDEX_DIM + t * 4, 4),
                  scale.to(torch.float32).contiguous().view(torch.uint8).view(-1, 4), keep)


def read_indexer_rows(cache: torch.Tensor, loc: torch.Tensor, page_size: int,
                      dialect: Fp8Dialect | None = None) -> torch.Tensor:
    """Dequantized indexer keys [N, 128] float32."""
    d = dialect or fp8_dialect()
    loc = loc.to(torch.int64)
    base = (loc // page_size) * indexer_page_bytes(page_size)
    t = loc % page_size
    flat = cache.view(-1)
    q = flat[_byte_index(base + t * INDEX_DIM, INDEX_DIM)].contiguous().view(d.torch_dtype)
    scale = flat[_byte_index(base + page_size * INDEX_DIM + t * 4, 4)].contiguous().view(torch.float32)
    return q.float() * scale
