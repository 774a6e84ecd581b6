"""The DeepSeek-V4 paged FP8 KV layout (SWA, C4 and C128 caches) and the indexer layout.

One token of a KV row takes 584 bytes: 448 fp8 "nope" values, 64 bf16 RoPE values (128 bytes),
7 ue8m0 scale bytes (one per 64-wide tile of the nope part) and one pad byte. A page of P tokens:

    [0, P*576)             token t's 576 value bytes at t*576 (448 fp8, then 64 bf16 little-endian)
    [P*576, P*584)         token t's 8 scale bytes at P*576 + t*8 (7 ue8m0 + 1 pad)
    [P*584, page_bytes(P)) zero padding: the page stride is a multiple of 576

A cache is a uint8 tensor [pages, bytes]: either contiguous with page_bytes(P) bytes per page, or a
view of the P*584 used bytes of each page whose stride(0) is the page stride (a host engine may
space pages further apart, e.g. when layers with different page sizes share a block). Writers and
readers take the page stride from `cache.stride(0)`, never from the formula.

Indexer cache: 132 bytes per token, page = [P*128 fp8 values][P*4 fp32 scales]. The value block
holds its keys in one of two orders, the key tile (`INDEX_KEY_TILES`): 0, row-major (slot o's
dim d at o*128 + d, this project's pool); 16, keys in 16 x 16 tiles (a block of 16 slots is
stored as eight 16 x 16 tiles, one per 16 dims, each tile row-major: slot o's dim d at
(o//16)*2048 + (d//16)*256 + (o%16)*16 + d%16; P must then be a multiple of 16). The scale
block is the same in both.

Non-finite input (NaN or +-inf) is stored poisoned, the same bytes in every backend, so that a
reader sees NaN rather than a plausible number: a 64-wide nope tile holding one gets every value
byte the dialect's NaN byte and scale byte 0xFF (ue8m0's NaN); a NaN RoPE value is stored as the
bf16 NaN 0x7FC0 (infinities as they are); an indexer key holding one gets NaN value bytes and a
NaN fp32 scale. `KernelOptions(refuse_nonfinite=True)` (DSV4_REFUSE_NONFINITE_KV=1) makes the
set-KV ops refuse such input instead.

The functions here are the torch reference (the CPU path and every kernel's test oracle).
"""

from __future__ import annotations

import torch

from .numerics import AMAX_FLOOR, DEFAULT_NUMERICS, StoreNumerics
from .platform import Fp8Dialect

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
TILE = 64
N_TILES = NOPE_DIM // TILE            # 7
VALUE_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = 8                        # 7 ue8m0 + 1 pad
TOKEN_BYTES = VALUE_BYTES + SCALE_BYTES  # 584
UE8M0_BIAS = 127
POISON_SCALE = 0xFF                    # the scale byte of a tile with a NaN or inf (ue8m0 NaN)
BF16_NAN = 0x7FC0                      # the one NaN encoding stored for a bf16 value
FP32_NAN = 0x7FC00000

INDEX_DIM = 128
INDEX_POW2_AMAX_FLOOR = 2.0 ** -126    # the smallest normal fp32: a power-of-two scale's floor
INDEX_TOKEN_BYTES = INDEX_DIM + 4      # 132
INDEX_KEY_TILES = (0, 16)              # 0: row-major keys; 16: keys in 16 x 16 tiles


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


def check_key_tile(key_tile, page_size: int) -> None:
    """key_tile one of INDEX_KEY_TILES, and page_size a whole number of tiles."""
    if isinstance(key_tile, bool) or key_tile not in INDEX_KEY_TILES:
        raise ValueError(f"key_tile must be 0 (row-major keys) or 16 (keys in 16 x 16 tiles), "
                         f"got {key_tile!r}")
    if key_tile and page_size % key_tile:
        raise ValueError(f"page_size must be a multiple of key_tile={key_tile} (whole tiles of "
                         f"slots), got {page_size}")


def indexer_value_offset(slot: torch.Tensor, dim: torch.Tensor, key_tile: int = 0) -> torch.Tensor:
    """Offset of (slot in page, dim) in a page's value block, in the key tile's order (see the
    module docstring); the arguments broadcast."""
    if not key_tile:
        return slot * INDEX_DIM + dim
    t = key_tile
    return (slot // t) * (t * INDEX_DIM) + (dim // t) * (t * t) + (slot % t) * t + dim % t


def value_offset(loc: torch.Tensor, page_size: int, page_stride: int | None = None) -> torch.Tensor:
    """int64 byte offset of each location's value bytes in a flattened cache (page_stride:
    bytes from one page to the next, default page_bytes(page_size))."""
    loc = loc.to(torch.int64)
    stride = page_stride or page_bytes(page_size)
    return (loc // page_size) * stride + (loc % page_size) * VALUE_BYTES


def scale_offset(loc: torch.Tensor, page_size: int, page_stride: int | None = None) -> torch.Tensor:
    """int64 byte offset of each location's 8 scale bytes in a flattened cache."""
    loc = loc.to(torch.int64)
    stride = page_stride or page_bytes(page_size)
    return (loc // page_size) * stride + page_size * VALUE_BYTES + (loc % page_size) * SCALE_BYTES


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a [pages, bytes] cache from its first byte to its last, pages at
    cache.stride(0) bytes apart (the gaps between strided pages included, never written)."""
    if cache.is_contiguous():
        return cache.view(-1)
    span = (cache.shape[0] - 1) * cache.stride(0) + cache.shape[1] if cache.shape[0] else 0
    return cache.as_strided((span,), (1,))


def exact_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor, correctly rounded on every device: torch on a GPU divides a tensor by a
    Python number as a product with its reciprocal (1 ulp off now and then), by a tensor not."""
    return x / torch.full_like(x, divisor)


def pow2_ceil_exponent(r: torch.Tensor) -> torch.Tensor:
    """ceil(log2(r)) for positive normal fp32 r, exactly, from the bits (no log2 rounding)."""
    bits = r.to(torch.float32).view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    return exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def quantize_kv_rows(x: torch.Tensor, dialect: Fp8Dialect,
                     numerics: StoreNumerics = DEFAULT_NUMERICS):
    """Quantize KV rows [N, 512] the way the cache stores them.

    The row is rounded to bf16 first (as the reference does; `numerics.round_to_bf16=False`
    quantizes the fp32 values). Each 64-wide tile of the nope part gets a power-of-two scale
    2^ceil(log2(max(amax, amax_floor) / FP8_MAX)); values are x / scale clamped to +-FP8_MAX and
    cast (round to nearest even). A tile holding a NaN or inf is stored poisoned (see the module
    docstring). Returns
    (nope [N, 448] fp8, rope [N, 64] bf16, scales [N, 7] uint8 ue8m0 = exponent + 127).
    """
    if x.dim() != 2 or x.shape[1] != HEAD_DIM:
        raise ValueError(f"x must be [N, {HEAD_DIM}], got {tuple(x.shape)}")
    fp8_max = numerics.fp8_max_for(dialect)
    xq = x.to(torch.bfloat16) if numerics.round_to_bf16 else x
    tiles = xq[:, :NOPE_DIM].float().view(-1, N_TILES, TILE)
    poisoned = ~torch.isfinite(tiles).all(dim=-1)
    amax = tiles.abs().amax(dim=-1).clamp_min(numerics.amax_floor)
    amax = torch.where(poisoned, torch.ones_like(amax), amax)
    exp = pow2_ceil_exponent(exact_div(amax, fp8_max))
    inv_scale = torch.ldexp(torch.ones_like(amax), -exp)
    q = (tiles * inv_scale.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(dialect.torch_dtype)
    q = torch.where(poisoned.unsqueeze(-1), dialect.nan_byte, q.view(torch.uint8))
    scales = torch.where(poisoned, POISON_SCALE, exp + UE8M0_BIAS).to(torch.uint8)
    rope = canonical_nan_bf16(x[:, NOPE_DIM:].to(torch.bfloat16))
    return q.view(-1, NOPE_DIM).view(dialect.torch_dtype), rope, scales


def canonical_nan_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16 x (contiguous copy) with every NaN as 0x7FC0, whatever its sign and payload."""
    bits = x.contiguous().view(torch.int16)
    return torch.where(x.isnan(), BF16_NAN, bits).view(torch.bfloat16)


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
    """Scatter packed rows into the cache at loc; rows with loc < 0 or past the cache's slots are
    skipped (so nothing lands outside the cache even without the host's range checks)."""
    keep = (loc >= 0) & (loc < cache.shape[0] * page_size)
    safe = torch.where(keep, loc, torch.zeros_like(loc))
    flat, stride = cache_bytes(cache), cache.stride(0)
    scatter_bytes(flat, _byte_index(value_offset(safe, page_size, stride), VALUE_BYTES), values,
                  keep)
    scatter_bytes(flat, _byte_index(scale_offset(safe, page_size, stride), SCALE_BYTES),
                  scale_bytes, keep)


def read_kv_bytes(cache: torch.Tensor, loc: torch.Tensor, page_size: int):
    """(value bytes [N, 576], scale bytes [N, 8]) of the rows at loc (all loc must be >= 0)."""
    flat, stride = cache_bytes(cache), cache.stride(0)
    values = flat[_byte_index(value_offset(loc, page_size, stride), VALUE_BYTES)]
    scale_bytes = flat[_byte_index(scale_offset(loc, page_size, stride), SCALE_BYTES)]
    return values, scale_bytes


def read_kv_rows(cache: torch.Tensor, loc: torch.Tensor, page_size: int,
                 dialect: Fp8Dialect) -> torch.Tensor:
    """Dequantized rows float32 [*loc.shape, 512] of a V4-layout cache ([pages, page bytes]) at
    loc (every loc >= 0). The one KV dequantizer: attention reads and tests use it. Whole rows
    are gathered through [page, offset] views of the page bytes (one index entry per row), and
    each tile is scaled by its power of two (exact)."""
    values = cache[:, :page_size * VALUE_BYTES].view(-1, page_size, VALUE_BYTES)
    scales = cache[:, page_size * VALUE_BYTES:page_size * TOKEN_BYTES].view(
        -1, page_size, SCALE_BYTES)
    loc = loc.long()
    page, off = loc // page_size, loc % page_size
    v = values[page, off]
    exp = scales[page, off][..., :N_TILES].to(torch.int32) - UE8M0_BIAS
    nope = v[..., :NOPE_DIM].view(dialect.torch_dtype).float().unflatten(-1, (N_TILES, TILE))
    nope = torch.ldexp(nope, exp.unsqueeze(-1).float()).flatten(-2)
    return torch.cat([nope, v[..., NOPE_DIM:].view(torch.bfloat16).float()], -1)


def quantize_indexer_rows(k: torch.Tensor, dialect: Fp8Dialect,
                          pow2_scale: bool = False):
    """Indexer keys [N, 128] -> (fp8 [N, 128], fp32 scale [N]); scale = max(amax, 1e-4) / FP8_MAX,
    or with pow2_scale 2^ceil(log2(max(amax, 2^-126) / FP8_MAX)): a power of two, so keys that
    are e2m1 values times a power of two (the model's FP4-simulated keys) read back exactly.
    A key holding a NaN or inf is stored poisoned: NaN value bytes, NaN scale."""
    if k.dim() != 2 or k.shape[1] != INDEX_DIM:
        raise ValueError(f"k must be [N, {INDEX_DIM}], got {tuple(k.shape)}")
    kf = k.float()
    poisoned = ~torch.isfinite(kf).all(dim=-1)
    if pow2_scale:
        ratio = exact_div(kf.abs().amax(dim=-1).clamp_min(INDEX_POW2_AMAX_FLOOR), dialect.max)
        scale = torch.ldexp(torch.ones_like(ratio), pow2_ceil_exponent(ratio))
    else:
        scale = exact_div(kf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR), dialect.max)
    scale = torch.where(poisoned, torch.ones_like(scale), scale)
    q = kf / scale.unsqueeze(-1)
    q = q.clamp(-dialect.max, dialect.max).to(dialect.torch_dtype).view(torch.uint8)
    q = torch.where(poisoned.unsqueeze(-1), dialect.nan_byte, q).view(dialect.torch_dtype)
    # a fill, not a copy from the host: graph capture on a GPU forbids pageable copies
    nan = torch.full_like(scale, FP32_NAN, dtype=torch.int32).view(torch.float32)
    return q, torch.where(poisoned, nan, scale)


def indexer_byte_index(loc: torch.Tensor, page_size: int, key_tile: int = 0):
    """int64 offsets in a flattened indexer cache of each location's key bytes [N, 128] (dim
    order, placed in the key tile's order) and fp32 scale bytes [N, 4] (every loc >= 0)."""
    loc = loc.to(torch.int64)
    base = (loc // page_size) * indexer_page_bytes(page_size)
    t = loc % page_size
    dims = torch.arange(INDEX_DIM, device=loc.device, dtype=torch.int64)
    values = base[:, None] + indexer_value_offset(t[:, None], dims, key_tile)
    return values, _byte_index(base + page_size * INDEX_DIM + t * 4, 4)


def write_indexer_bytes(cache: torch.Tensor, loc: torch.Tensor, page_size: int,
                        q: torch.Tensor, scale: torch.Tensor, key_tile: int = 0) -> None:
    """Scatter quantized indexer rows into the 132-byte layout, the values in the key tile's
    order; rows with loc < 0 or past the cache's slots are skipped."""
    check_key_tile(key_tile, page_size)
    keep = (loc >= 0) & (loc < cache.shape[0] * page_size)
    safe = torch.where(keep, loc, torch.zeros_like(loc))
    values, scales = indexer_byte_index(safe, page_size, key_tile)
    flat = cache.view(-1)
    scatter_bytes(flat, values, q.contiguous().view(torch.uint8), keep)
    scatter_bytes(flat, scales, scale.to(torch.float32).contiguous().view(torch.uint8).view(-1, 4),
                  keep)


def read_indexer_rows(cache: torch.Tensor, loc: torch.Tensor, page_size: int,
                      dialect: Fp8Dialect, key_tile: int = 0) -> torch.Tensor:
    """Dequantized indexer keys float32 [*loc.shape, 128] of an indexer cache ([pages, page
    bytes]: page = [P x 128 fp8, in the key tile's order][P x 4 fp32 scale]) at loc (every
    loc >= 0). Each key is gathered through a view of the value block (one index per key)."""
    check_key_tile(key_tile, page_size)
    block = cache[:, :page_size * INDEX_DIM]
    scales = cache[:, page_size * INDEX_DIM:page_size * (INDEX_DIM + 4)].view(-1, page_size, 4)
    loc = loc.long()
    page, off = loc // page_size, loc % page_size
    if key_tile:
        t = key_tile       # [page, slot block, dim block, slot in block, dim in block]
        tiles = block.view(-1, page_size // t, INDEX_DIM // t, t, t)
        values = tiles[page, off // t, :, off % t, :].flatten(-2)
    else:
        values = block.view(-1, page_size, INDEX_DIM)[page, off]
    q = values.view(dialect.torch_dtype).float()
    return q * scales[page, off].view(torch.float32)
