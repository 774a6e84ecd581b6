"""Triton building blocks of the set-KV kernels: one 512-wide V4 KV row per program.

A row is held as a [8, 64] nope block (tiles 0..6; tile 7 is masked padding so the block is a
power of two) and a [32, 2] block of interleaved RoPE pairs. Every load is upcast to fp32 before
arithmetic; every rounding matches `set_kv_ref` (RNE casts, `sqrt_rn`/`div_rn`, kernels compiled
with fp fusion off so `a*c - b*d` is never contracted into an fma). Byte offsets are int64 and
computed only by `kv_value_offset` / `kv_scale_offset` / `indexer_offsets` (with
`indexer_dim_offsets`), which the tests call with locations whose offsets pass 2^31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kv_layout as L

HEAD_DIM = tl.constexpr(L.HEAD_DIM)
NOPE_DIM = tl.constexpr(L.NOPE_DIM)
TILE = tl.constexpr(L.TILE)
N_TILES = tl.constexpr(L.N_TILES)
TILE_BLOCK = tl.constexpr(8)            # N_TILES padded to a power of two
PAIRS = tl.constexpr(L.ROPE_DIM // 2)
VALUE_BYTES = tl.constexpr(L.VALUE_BYTES)
SCALE_BYTES = tl.constexpr(L.SCALE_BYTES)
INDEX_DIM = tl.constexpr(L.INDEX_DIM)
AMAX_FLOOR = tl.constexpr(L.AMAX_FLOOR)
INDEX_POW2_AMAX_FLOOR = tl.constexpr(L.INDEX_POW2_AMAX_FLOOR)
UE8M0_BIAS = tl.constexpr(L.UE8M0_BIAS)
POISON_SCALE = tl.constexpr(L.POISON_SCALE)
BF16_NAN = tl.constexpr(L.BF16_NAN)
FP32_NAN = tl.constexpr(L.FP32_NAN)
FLT_MAX = tl.constexpr(3.4028234663852886e38)

# Launch options of every set-KV kernel (also used by the ahead-of-time compile): one wave64 per
# row gives 16-byte loads per lane; no fp contraction so results match the torch reference.
LAUNCH_OPTIONS = {"num_warps": 1, "enable_fp_fusion": False}


def fp8_type(dialect):
    """Triton fp8 type of a platform dialect: float8e4b8 (fnuz) or float8e4nv (OCP)."""
    return getattr(tl, dialect.triton_name)


def fp8_constexprs(dialect, fp8_max=None, device=None) -> dict:
    """The FP8, FP8_MAX, FP8_NAN and SOFT_FP8 arguments of the quantizing kernels for a dialect
    and the device of the cache (None: a GPU)."""
    return {"FP8": fp8_type(dialect), "FP8_MAX": dialect.max if fp8_max is None else fp8_max,
            "FP8_NAN": dialect.nan_byte,
            "SOFT_FP8": device is not None and torch.device(device).type == "cpu"}


@triton.jit
def is_finite(x):
    """True where fp32 x is neither NaN nor +-inf."""
    return tl.abs(x) <= FLT_MAX


@triton.jit
def canonical_nan_bf16(x):
    """bf16 x with every NaN as the one stored encoding 0x7FC0."""
    bits = x.to(tl.uint16, bitcast=True)
    nan = x.to(tl.float32) != x.to(tl.float32)
    return tl.where(nan, BF16_NAN, bits).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def kv_value_offset(loc, PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr):
    """int64 byte offset of a location's 576 value bytes: page * PAGE_BYTES + t * 576."""
    loc = loc.to(tl.int64)
    return (loc // PAGE_SIZE) * PAGE_BYTES + (loc % PAGE_SIZE) * VALUE_BYTES


@triton.jit
def kv_scale_offset(loc, PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr):
    """int64 byte offset of a location's 8 scale bytes: page * PAGE_BYTES + P*576 + t * 8."""
    loc = loc.to(tl.int64)
    return ((loc // PAGE_SIZE) * PAGE_BYTES + PAGE_SIZE * VALUE_BYTES
            + (loc % PAGE_SIZE) * SCALE_BYTES)


@triton.jit
def indexer_offsets(loc, PAGE_SIZE: tl.constexpr, KEY_TILE: tl.constexpr):
    """int64 byte offsets (dim 0 of the key, fp32 scale) of a location in the 132-byte indexer
    layout whose keys are in KEY_TILE's order (`kv_layout.indexer_value_offset`); dim d of the
    key is at the first plus `indexer_dim_offsets(d, KEY_TILE)`."""
    loc = loc.to(tl.int64)
    base = (loc // PAGE_SIZE) * (PAGE_SIZE * (INDEX_DIM + 4))
    t = loc % PAGE_SIZE
    if KEY_TILE == 0:
        value = base + t * INDEX_DIM
    else:
        value = base + (t // KEY_TILE) * (KEY_TILE * INDEX_DIM) + (t % KEY_TILE) * KEY_TILE
    return value, base + PAGE_SIZE * INDEX_DIM + t * 4


@triton.jit
def indexer_dim_offsets(dims, KEY_TILE: tl.constexpr):
    """Offsets of key dims from the key's dim 0 in KEY_TILE's order: the dims themselves
    (row-major), or (d // KEY_TILE) * KEY_TILE^2 + d % KEY_TILE (tiles)."""
    if KEY_TILE == 0:
        return dims
    else:
        return (dims // KEY_TILE) * (KEY_TILE * KEY_TILE) + dims % KEY_TILE


@triton.jit
def nope_offsets():
    """[8, 64] element offsets of the nope tiles and the mask of the 7 real tiles."""
    tile = tl.arange(0, TILE_BLOCK)[:, None]
    offs = tile * TILE + tl.arange(0, TILE)[None, :]
    return offs, tile < N_TILES


@triton.jit
def rope_offsets():
    """[32, 2] element offsets of the 64 RoPE values as interleaved (a, b) pairs."""
    return tl.arange(0, PAIRS)[:, None] * 2 + tl.arange(0, 2)[None, :]


@triton.jit
def load_nope(row_ptr):
    offs, mask = nope_offsets()
    return tl.load(row_ptr + offs, mask=mask, other=0.0)


@triton.jit
def load_rope(rope_ptr):
    """The 64 RoPE values as [32, 2] pairs; rope_ptr points at dim 448 of a row."""
    return tl.load(rope_ptr + rope_offsets())


@triton.jit
def rms_inverse(nope, rope, eps, RMS_DEVICE: tl.constexpr = False):
    """1 / rms of a 512-wide row given as fp32 nope [448] and rope [64] values of bf16 inputs.
    Exact (RMS_DEVICE False): 1 / sqrt_rn(mean(x^2) + eps), the sum of squares taken in fp64,
    where it is exact (16-bit squares), so it does not depend on the reduction order. Device:
    rsqrt(fp32 mean + eps), the reference's, in this device's summation order and rsqrt."""
    if RMS_DEVICE:
        ms = (tl.sum(nope * nope) + tl.sum(rope * rope)) / HEAD_DIM
        return tl.math.rsqrt(ms + eps)
    n64 = nope.to(tl.float64)
    r64 = rope.to(tl.float64)
    ss = tl.sum(n64 * n64) + tl.sum(r64 * r64)
    ms = (ss / HEAD_DIM).to(tl.float32)
    return tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(ms + eps))


@triton.jit
def bf16_rms_inverse(nope, rope, eps):
    """The reference's weightless q norm factor, each op rounded to bf16: rsqrt(bf16(mean of
    bf16(x^2)) + eps), of fp32 nope/rope values of bf16 inputs; returned as bf16 in fp32."""
    nope_sq = (nope * nope).to(tl.bfloat16).to(tl.float32)
    rope_sq = (rope * rope).to(tl.bfloat16).to(tl.float32)
    ms = ((tl.sum(nope_sq) + tl.sum(rope_sq)) / HEAD_DIM).to(tl.bfloat16).to(tl.float32)
    ms = (ms + eps).to(tl.bfloat16).to(tl.float32)
    return tl.math.rsqrt(ms).to(tl.bfloat16).to(tl.float32)


@triton.jit
def rotate_pairs(rope, freq_row_ptr, freq_stride_pair):
    """Interleaved RoPE of fp32 pairs [32, 2] with cos/sin from a float32 view of complex64
    freqs: (a, b) -> (a*c - b*d, a*d + b*c), rounded to bf16."""
    cs = tl.load(freq_row_ptr + tl.arange(0, PAIRS)[:, None] * freq_stride_pair
                 + tl.arange(0, 2)[None, :])
    c, d = tl.split(cs)
    a, b = tl.split(rope)
    return tl.join(a * c - b * d, a * d + b * c).to(tl.bfloat16)


@triton.jit
def rotate_pairs_fma(rope, freq_row_ptr, freq_stride_pair):
    """RoPE of fp32 pairs [32, 2] rounded as fma(a, c, rn(-b*d)), fma(b, c, rn(a*d)), to bf16
    (`StoreNumerics.q_mode` "rope_only")."""
    cs = tl.load(freq_row_ptr + tl.arange(0, PAIRS)[:, None] * freq_stride_pair
                 + tl.arange(0, 2)[None, :])
    c, d = tl.split(cs)
    a, b = tl.split(rope)
    return tl.join(tl.fma(a, c, -(b * d)), tl.fma(b, c, a * d)).to(tl.bfloat16)


@triton.jit
def fp8_bits(x, FP8: tl.constexpr, FP8_NAN: tl.constexpr, SOFT_FP8: tl.constexpr):
    """The e4m3 byte of fp32 x (|x| <= the dialect's max), rounded to nearest even. A GPU
    converts in hardware. SOFT_FP8 (the interpreter, on a CPU) rounds in integer arithmetic as
    csrc/fp8.cuh's fp8_from_float: Triton 3.7's interpreter rounds a cast's halves up and drops
    the mantissa carry, which stored other bytes than torch and the HIP kernel. The fnuz dialect
    (NaN byte 0x80) has no -0."""
    if not SOFT_FP8:
        return x.to(FP8).to(tl.uint8, bitcast=True)
    BIAS: tl.constexpr = FP8.exponent_bias
    u = x.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    biased = a >> 23
    # fp8 normal: the 23-bit mantissa rounded to 3 bits; a carry bumps the exponent
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - BIAS) << 3)
    # fp8 subnormal: quanta of 2^(-bias-2), the remainder rounded to even (a shift of 25
    # leaves 0: a 24-bit significand has no bit there)
    sig = tl.where(biased != 0, (a & 0x7FFFFF) | 0x800000, a)
    shift = tl.minimum(tl.maximum((148 - BIAS) - biased.to(tl.int32), 21), 25)
    shift = tl.where(biased != 0, shift, 25).to(tl.uint32)
    quanta = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    quanta += ((rem > half) | ((rem == half) & ((quanta & 1) != 0))).to(tl.uint32)
    mag = tl.where(biased >= 128 - BIAS, normal, quanta)
    sign = (u >> 24) & 0x80
    if FP8_NAN == 0x80:
        sign = tl.where(mag == 0, 0, sign)
    return (sign | mag).to(tl.uint8)


@triton.jit
def quantize_tiles(nope, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                   TILE_AMAX_FLOOR: tl.constexpr, FP8_NAN: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Per-tile fp8 quantization of fp32 nope [8, 64]: scale 2^e with
    e = ceil(log2(max(amax, TILE_AMAX_FLOOR) / FP8_MAX)) from the fp32 bits; a tile holding a
    NaN or inf is poisoned (FP8_NAN bytes, scale byte 0xFF). Returns (fp8 bytes [8, 64], scale
    bytes [8]: 7 ue8m0 + a zero pad byte)."""
    poisoned = tl.min(is_finite(nope).to(tl.int32), axis=1) == 0
    amax = tl.maximum(tl.max(tl.abs(nope), axis=1), TILE_AMAX_FLOOR)
    amax = tl.where(poisoned, 1.0, amax)
    bits = tl.div_rn(amax, tl.full([TILE_BLOCK], FP8_MAX, tl.float32)).to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv_scale = ((127 - exp) << 23).to(tl.float32, bitcast=True)
    x = nope * inv_scale[:, None]
    q = fp8_bits(tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX), FP8, FP8_NAN, SOFT_FP8)
    q = tl.where(poisoned[:, None], FP8_NAN, q).to(tl.uint8)
    tile = tl.arange(0, TILE_BLOCK)
    scale = tl.where(poisoned, POISON_SCALE, exp + UE8M0_BIAS)
    scale_bytes = tl.where(tile < N_TILES, scale, 0).to(tl.uint8)
    return q, scale_bytes


@triton.jit
def store_kv_row(cache_ptr, loc, keep, nope_bytes, rope_bf16, scale_bytes,
                 PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr):
    """Write one row in the V4 layout (nothing when keep is false): nope_bytes uint8 [8, 64]
    (tile 7 ignored), rope_bf16 [32, 2], scale_bytes uint8 [8]."""
    values = cache_ptr + kv_value_offset(loc, PAGE_SIZE, PAGE_BYTES)
    offs, mask = nope_offsets()
    tl.store(values + offs, nope_bytes, mask=mask & keep)
    rope_ptr = (values + NOPE_DIM).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_ptr + rope_offsets(), rope_bf16, mask=keep)
    scales = cache_ptr + kv_scale_offset(loc, PAGE_SIZE, PAGE_BYTES)
    tl.store(scales + tl.arange(0, SCALE_BYTES), scale_bytes, mask=keep)
