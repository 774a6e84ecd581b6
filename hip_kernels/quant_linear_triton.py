"""The Triton kernels of `quant_linear`: DeepSeek-V4's FP8 and FP4 linears with the activation
quantization fused into the GEMM, for decode (few rows, large N and K).

One program per (expert, block of BLOCK_N output columns, slice of the rows): it walks its
expert's rows (rows [offs[e-1], offs[e]); a dense linear is one group) BLOCK_M at a time, and
for each 128-wide K block quantizes those rows in registers as the reference's act_quant does
(every program re-quantizes its rows: cheap at decode), then multiplies them with the weight
tile. FP8: one fp8 x fp8 `tl.dot` per 128-wide K block (fp32 result), scaled by
sa * sb and added to the fp32 accumulator, stored in the output's dtype (bf16, or fp32 for a
tensor-parallel rank's partial product). FP4: the e2m1 codes are unpacked with bit
arithmetic (two per byte, the even element in the low nibble) into exact fp32 values, one dot
per 32-wide K block (bf16 operands: the fp8 and e2m1 values are exact in bf16), scaled by
sa then sb. One bf16 rounding at the store. Scale multiplies and adds are not fused
(enable_fp_fusion off), as in the torch reference.

EXACT_DOT (the interpreter's mode) feeds the same values to a float64 dot, whose sum of exact
products is exact, rounded once to fp32: bit for bit the torch reference. On a GPU the matrix
cores sum in their own fp32 order (see `quant_linear_ref`).

fnuz (gfx942): FP8 activations are stored as fnuz(clamp(x / s) / 2) with scale 2s against a
weight converted by `ocp_to_fnuz`; FP4 uses the platform's fp8 type only to round the
activations (fnuz(y / 2) * 2 is the OCP value exactly).

gfx950's MXFP4 matrix cores (`tl.dot_scaled`, e4m3 x e2m1 with e8m0 scales) are not used:
Triton 3.7.1 compiles it for gfx950 (v_mfma_scale_f32_16x16x128_f8f6f4) but its interpreter has
no dot_scaled and gfx942 fails to compile it, so that path could not be tested here.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from . import quant_linear_ref as R
from .platform import DIALECTS, FNUZ, OCP, triton_interpreted
from .triton_kv_row import fp8_type

AMAX_FLOOR = tl.constexpr(R.AMAX_FLOOR)
FP8_MAX = tl.constexpr(R.FP8_MAX)
INV_FP8_MAX = tl.constexpr(1.0 / R.FP8_MAX)

BLOCK_NS = (64, 32, 16)  # output columns per program: each divides 128 (one FP8 weight scale)
MIN_PROGRAMS = 256      # enough programs to stream the weight on every CU of an MI300 (304)
MIN_BLOCK_M = 16        # the smallest tl.dot tile
MAX_BLOCK_M = 64
MAX_ROW_SPLIT = 16
# Four waves; one stage: software pipelining measured 146 -> 215 VGPRs on gfx942 (fp8, 16 rows)
LAUNCH_OPTIONS = {"num_warps": 4, "num_stages": 1, "enable_fp_fusion": False}


@triton.jit
def _e8m0_to_fp32(byte):
    """ue8m0 byte -> fp32 2^(byte - 127): 0 is 2^-127 (an fp32 subnormal), 255 NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_scale(ptr, E8M0: tl.constexpr):
    if E8M0:
        return _e8m0_to_fp32(tl.load(ptr))
    return tl.load(ptr).to(tl.float32)


@triton.jit
def _act_scale(amax, ROUND_SCALE: tl.constexpr):
    """The reference's act_quant scale of fp32 row maxima: amax floored at 1e-4, times fp32
    1/448, rounded up to a power of two from its bits when ROUND_SCALE (ue8m0)."""
    s = tl.maximum(amax, AMAX_FLOOR) * INV_FP8_MAX
    if ROUND_SCALE:
        bits = s.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (exponent << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _divide(x, s, ROUND_SCALE: tl.constexpr):
    """x / s[:, None], correctly rounded. A power-of-two s (ROUND_SCALE) has an exact
    reciprocal: one multiply per element gives the quotient exactly; otherwise an IEEE division
    (div_rn: Triton's `/` may be approximate on a GPU), as the reference divides."""
    if ROUND_SCALE:
        return x * (1.0 / s)[:, None]
    return tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape))


@triton.jit
def _row_range(offs_ptr, n_rows, GROUPED: tl.constexpr):
    e = tl.program_id(0)
    if GROUPED:     # clamped to the rows: a bad offs never reads or writes past them
        start = tl.minimum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), n_rows)
        end = tl.minimum(tl.load(offs_ptr + e), n_rows)
    else:
        start = 0
        end = n_rows
    return start, end


@triton.jit
def _row_dot(a, b, EXACT_DOT: tl.constexpr):
    """a [M, K] times b [K, N] in fp32: bf16 / fp8 matrix cores, or for one row (a decode pair of
    the fused MoE; tl.dot needs 16 rows) a broadcast multiply and sum. EXACT_DOT: in float64,
    exact for these sums of exact products, rounded once to fp32."""
    if EXACT_DOT:
        a64 = a.to(tl.float32).to(tl.float64)
        b64 = b.to(tl.float32).to(tl.float64)
        if a.shape[0] == 1:
            return tl.sum(tl.trans(a64) * b64, axis=0, keep_dims=True).to(tl.float32)
        return tl.dot(a64, b64).to(tl.float32)
    if a.shape[0] == 1:
        return tl.sum(tl.trans(a.to(tl.float32)) * b.to(tl.float32), axis=0, keep_dims=True)
    return tl.dot(a, b)


@triton.jit
def fp8_k128(acc, x_rows, row_ok, w_base, ws_base, col_ok, k0, FP8: tl.constexpr,
             FNUZ_ACT: tl.constexpr, ROUND_SCALE: tl.constexpr, SCALE_E8M0: tl.constexpr,
             EXACT_DOT: tl.constexpr):
    """acc [M, N] + the rows' 128 K values from k0 (x_rows [M, 1]: the rows' pointers; one
    activation scale) times the FP8 weight's block (w_base [1, N]: the columns' rows; ws_base:
    the columns' 128x128 scale row)."""
    kk = tl.arange(0, 128)
    x = tl.load(x_rows + k0 + kk[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    s = _act_scale(tl.max(tl.abs(x), axis=1), ROUND_SCALE)
    y = tl.clamp(_divide(x, s, ROUND_SCALE), -FP8_MAX, FP8_MAX)
    if FNUZ_ACT:
        y = y * 0.5
        s = s * 2.0
    b = tl.load(w_base + k0 + kk[:, None], mask=col_ok[None, :], other=0)
    partial = _row_dot(y.to(FP8), b.to(FP8, bitcast=True), EXACT_DOT)
    sb = _load_scale(ws_base + k0 // 128, SCALE_E8M0)
    return acc + partial * (s[:, None] * sb)


@triton.jit
def fp8_linear_kernel(x_ptr, x_stride, w_ptr, w_stride_e, w_stride_n, ws_ptr, ws_stride_e,
                      ws_stride_n, offs_ptr, out_ptr, out_stride, n_rows, n_out, K,
                      FP8: tl.constexpr, FNUZ_ACT: tl.constexpr, ROUND_SCALE: tl.constexpr,
                      SCALE_E8M0: tl.constexpr, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, EXACT_DOT: tl.constexpr):
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    start, end = _row_range(offs_ptr, n_rows, GROUPED)
    w_base = w_ptr + e.to(tl.int64) * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n
    ws_base = (ws_ptr + e.to(tl.int64) * ws_stride_e
               + (tl.program_id(1) * BLOCK_N // 128) * ws_stride_n)
    step = tl.num_programs(2) * BLOCK_M
    for m0 in range(start + tl.program_id(2) * BLOCK_M, end, step):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        x_rows = x_ptr + rows[:, None].to(tl.int64) * x_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, 128):
            acc = fp8_k128(acc, x_rows, row_ok, w_base, ws_base, col_ok, k0, FP8, FNUZ_ACT,
                           ROUND_SCALE, SCALE_E8M0, EXACT_DOT)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _e2m1_to_fp32(code):
    """4-bit e2m1 code (int32) -> its exact fp32 value, from the bits."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    bits = tl.where(exponent == 0, mantissa * 0x3F000000, normal)      # 0 or 0.5 when subnormal
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_block(acc, x, s, w_block, ws_block, col_ok, k0, FP8: tl.constexpr,
               FP8_HALVES: tl.constexpr, ROUND_SCALE: tl.constexpr, EXACT_DOT: tl.constexpr):
    """acc + (x's 32 columns quantized with row scale s) . (the weight's 32 K values) * s * sb."""
    y = tl.clamp(_divide(x, s, ROUND_SCALE), -FP8_MAX, FP8_MAX)
    if FP8_HALVES:      # fnuz: the value is rounded on half the grid, then doubled (exact)
        a = (y * 0.5).to(FP8).to(tl.float32) * 2.0
    else:
        a = y.to(FP8).to(tl.float32)
    kk = tl.arange(0, 32)
    packed = tl.load(w_block + (k0 + kk[:, None]) // 2, mask=col_ok[None, :], other=0)
    b = _e2m1_to_fp32((packed.to(tl.int32) >> ((kk[:, None] & 1) * 4)) & 0xF)
    partial = _row_dot(a.to(tl.bfloat16), b.to(tl.bfloat16), EXACT_DOT)
    sb = _e8m0_to_fp32(tl.load(ws_block + k0 // 32, mask=col_ok, other=127))
    return acc + partial * s[:, None] * sb[None, :]


@triton.jit
def fp4_k128(acc, x_rows, row_ok, w_block, ws_block, col_ok, k0, FP8: tl.constexpr,
             FP8_HALVES: tl.constexpr, ROUND_SCALE: tl.constexpr, EXACT_DOT: tl.constexpr):
    """acc [M, N] + the rows' 128 K values from k0 (x_rows [M, 32]: pointers to the rows'
    first 32; one activation scale) times the FP4 weight's four blocks of 32 (w_block [1, N]:
    the packed rows of the columns, ws_block [N]: their scale rows)."""
    x0 = tl.load(x_rows + k0, mask=row_ok[:, None], other=0.0).to(tl.float32)
    x1 = tl.load(x_rows + k0 + 32, mask=row_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + k0 + 64, mask=row_ok[:, None], other=0.0).to(tl.float32)
    x3 = tl.load(x_rows + k0 + 96, mask=row_ok[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1)),
                      tl.maximum(tl.max(tl.abs(x2), axis=1), tl.max(tl.abs(x3), axis=1)))
    s = _act_scale(amax, ROUND_SCALE)
    acc = _fp4_block(acc, x0, s, w_block, ws_block, col_ok, k0, FP8, FP8_HALVES, ROUND_SCALE,
                     EXACT_DOT)
    acc = _fp4_block(acc, x1, s, w_block, ws_block, col_ok, k0 + 32, FP8, FP8_HALVES,
                     ROUND_SCALE, EXACT_DOT)
    acc = _fp4_block(acc, x2, s, w_block, ws_block, col_ok, k0 + 64, FP8, FP8_HALVES,
                     ROUND_SCALE, EXACT_DOT)
    return _fp4_block(acc, x3, s, w_block, ws_block, col_ok, k0 + 96, FP8, FP8_HALVES,
                      ROUND_SCALE, EXACT_DOT)


@triton.jit
def fp4_linear_kernel(x_ptr, x_stride, w_ptr, w_stride_e, w_stride_n, ws_ptr, ws_stride_e,
                      ws_stride_n, offs_ptr, out_ptr, out_stride, n_rows, n_out, K,
                      FP8: tl.constexpr, FP8_HALVES: tl.constexpr, ROUND_SCALE: tl.constexpr,
                      GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      EXACT_DOT: tl.constexpr):
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    start, end = _row_range(offs_ptr, n_rows, GROUPED)
    kk = tl.arange(0, 32)
    w_block = w_ptr + e.to(tl.int64) * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n
    ws_block = ws_ptr + e.to(tl.int64) * ws_stride_e + cols.to(tl.int64) * ws_stride_n
    step = tl.num_programs(2) * BLOCK_M
    for m0 in range(start + tl.program_id(2) * BLOCK_M, end, step):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        x_rows = x_ptr + rows[:, None].to(tl.int64) * x_stride + kk[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, 128):     # one activation scale per 128
            acc = fp4_k128(acc, x_rows, row_ok, w_block, ws_block, col_ok, k0, FP8,
                           FP8_HALVES, ROUND_SCALE, EXACT_DOT)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :],
                 acc.to(tl.bfloat16), mask=row_ok[:, None] & col_ok[None, :])


def block_m(rows_per_group: int) -> int:
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(max(rows_per_group, 1))))


def block_n(n_groups: int, n_out: int) -> int:
    """The widest column block that still gives MIN_PROGRAMS programs (K is never split: the
    reference accumulates the K blocks in order, and so does every program)."""
    for bn in BLOCK_NS[:-1]:
        if n_groups * triton.cdiv(n_out, bn) >= MIN_PROGRAMS:
            return bn
    return BLOCK_NS[-1]


def quant_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        offs: torch.Tensor | None, round_scale: bool, fp4: bool,
                        act_dialect, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[P, N] in out_dtype (checked arguments; see `quant_linear`; float32 only for FP8).
    weight [E, N, K] fp8 or [E, N, K/2] packed e2m1 bytes, weight_scale [E, *, *]; offs None for
    a dense linear (E == 1). FP8: the activations take the weight's dialect; FP4: act_dialect
    (the platform's) rounds them."""
    p, k = x.shape
    n_groups, n_out = weight.shape[:2]
    grouped = offs is not None
    out = (torch.zeros if grouped else torch.empty)(p, n_out, dtype=out_dtype, device=x.device)
    if p == 0 or n_out == 0:
        return out
    rows_per_group = -(-p // n_groups)
    bm = block_m(rows_per_group)
    row_split = min(MAX_ROW_SPLIT, -(-rows_per_group // bm))
    bn = block_n(n_groups, n_out)
    grid = (n_groups, triton.cdiv(n_out, bn), row_split)
    exact = triton_interpreted()
    e8m0 = weight_scale.dtype in (torch.uint8, torch.float8_e8m0fnu)
    scale = weight_scale.view(torch.uint8) if e8m0 else weight_scale.float()
    common = (x, x.stride(0), weight.view(torch.uint8), weight.stride(0), weight.stride(1), scale,
              scale.stride(0), scale.stride(1), offs if grouped else x, out, out.stride(0), p,
              n_out, k)
    if fp4:
        fp4_linear_kernel[grid](*common, FP8=fp8_type(act_dialect),
                                FP8_HALVES=act_dialect is FNUZ, ROUND_SCALE=round_scale,
                                GROUPED=grouped, BLOCK_M=bm, BLOCK_N=bn, EXACT_DOT=exact,
                                **LAUNCH_OPTIONS)
    else:
        fnuz = weight.dtype == torch.float8_e4m3fnuz
        fp8_linear_kernel[grid](*common, FP8=fp8_type(FNUZ if fnuz else OCP),
                                FNUZ_ACT=fnuz, ROUND_SCALE=round_scale, SCALE_E8M0=e8m0,
                                GROUPED=grouped, BLOCK_M=bm, BLOCK_N=bn, EXACT_DOT=exact,
                                **LAUNCH_OPTIONS)
    return out


def fp8_linear_triton(x, weight, weight_scale, round_scale, out_dtype):
    """The fp8_linear op's triton backend: a dense linear is one group."""
    return quant_linear_triton(x, weight[None], weight_scale[None], None, round_scale, False, OCP,
                               out_dtype)


def fp8_grouped_linear_triton(x, weight, weight_scale, offs, round_scale):
    """The fp8_grouped_linear op's triton backend."""
    return quant_linear_triton(x, weight, weight_scale, offs, round_scale, False, OCP)


def fp4_grouped_linear_triton(x, weight, weight_scale, offs, round_scale, dialect):
    """The fp4_grouped_linear op's triton backend (dialect: the fp8 dialect's name)."""
    return quant_linear_triton(x, weight, weight_scale, offs, round_scale, True,
                               DIALECTS[dialect])
