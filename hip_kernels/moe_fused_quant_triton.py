"""The Triton kernels of `moe_fused` for the published weight formats: the routed experts FP4
(packed e2m1 + one ue8m0 scale per 32 inputs), the shared expert FP8 (128x128 block scales).

The launches of the bf16 kernels (`moe_fused_triton`), no sort: gate_up, one program per (row,
block of BLOCK_N inter columns), the row's w1 and w3 products, the clamped SwiGLU times the
pair's weight -> bf16 h [rows, inter]; down, one program per (token, block of BLOCK_N D
columns): the token's h rows times w2, each rounded to bf16, added in ascending (expert, slot)
order in fp32 (routed), or added to the routed sum and rounded to x's dtype (shared).

Each product is the quantized linear's (`quant_linear_triton`'s fp4_k128 / fp8_k128, the same
code): per 128-wide K block the row is quantized as the reference's act_quant does (every
program re-quantizes its row: cheap at decode; the down GEMM quantizes h's rows, as the grouped
GEMM quantizes its input), the weight tile is decoded in registers (e2m1 codes from their bits
times a ue8m0 scale per 32, or fp8 with its block's scale), each block's partial is scaled and
added to the fp32 accumulator in K order, and the result is rounded to bf16 where the quantized
linear rounds it.

Numerics. One row per program: a partial is a broadcast multiply and sum over 32 (FP4) or 128
(FP8) exact products, in fp32 in Triton's order on a GPU, in float64 in the interpreter
(EXACT_DOT: the exactly rounded partial, as the torch reference). SiLU is Triton's sigmoid, so
an h value may differ from the reference's in its last bf16 bit, which moves one input of the
down GEMM's quantization: agreement within a stated tolerance, not bit for bit.

`moe_routed_triton` and `moe_shared_triton` are the ops' triton backends for every weight
format: these kernels for FP4 / FP8 weights, `moe_fused_triton`'s for bf16 ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_fused_triton import (moe_routed_bf16_triton, moe_shared_bf16_triton, next_pair,
                               pair_of, weighted_swiglu)
from .platform import DIALECTS, FNUZ, OCP, triton_interpreted
from .quant_linear_triton import LAUNCH_OPTIONS, fp4_k128, fp8_k128
from .triton_kv_row import fp8_type

# 16 columns a program: <= 64 VGPRs with quant_linear's four waves (32 measured 72-76 on gfx942 /
# gfx950), so 8 waves fit a SIMD; divides 128: one FP8 block scale per program and K block
BLOCK_N = 16
E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


@triton.jit
def _times_weight(row_ptr, w_ptr, s_ptr, expert, n, n_ok, K_IN, N_OUT, FP4: tl.constexpr,
                  FP8: tl.constexpr, HALVES: tl.constexpr, SCALE_E8M0: tl.constexpr,
                  BLOCK_N: tl.constexpr, EXACT_DOT: tl.constexpr):
    """The quantized row (K_IN bf16 values at row_ptr) times the columns n (this program's
    BLOCK_N) of the weight [(E,) N_OUT, K_IN], fp32 [1, BLOCK_N]: FP4 [E, N_OUT, K_IN/2] with
    ue8m0 s [E, N_OUT, K_IN/32], or FP8 [N_OUT, K_IN] with s [ceil(N_OUT/128), K_IN/128]."""
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    row_ok = tl.full([1], 1, tl.int1)
    if FP4:
        w_block = w_ptr + (expert * N_OUT + n[None, :].to(tl.int64)) * (K_IN // 2)
        s_block = s_ptr + (expert * N_OUT + n.to(tl.int64)) * (K_IN // 32)
        x_rows = row_ptr + tl.arange(0, 32)[None, :]
        for k0 in range(0, K_IN, 128):
            acc = fp4_k128(acc, x_rows, row_ok, w_block, s_block, n_ok, k0, FP8, HALVES, True,
                           EXACT_DOT)
    else:
        w_base = w_ptr + n[None, :].to(tl.int64) * K_IN
        s_base = s_ptr + (tl.program_id(1) * BLOCK_N // 128) * (K_IN // 128)
        x_rows = row_ptr + tl.zeros([1, 1], dtype=tl.int64)
        for k0 in range(0, K_IN, 128):
            acc = fp8_k128(acc, x_rows, row_ok, w_base, s_base, n_ok, k0, FP8, HALVES, True,
                           SCALE_E8M0, EXACT_DOT)
    return acc


@triton.jit
def quant_gate_up_kernel(x_ptr, indices_ptr, weights_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
                         D, INTER, limit, K: tl.constexpr, ROUTED: tl.constexpr,
                         FP4: tl.constexpr, FP8: tl.constexpr, HALVES: tl.constexpr,
                         SCALE_E8M0: tl.constexpr, BLOCK_N: tl.constexpr,
                         EXACT_DOT: tl.constexpr):
    """h[p] = bf16(weight * silu(min(gate, limit)) * clamp(up, +-limit)), gate and up the
    quantized linears' bf16 outputs of the pair's token row (ROUTED: row p // K, expert
    indices[p], weight weights[p]; else row p, one expert, weight 1)."""
    p = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    token, expert, weight = pair_of(p, indices_ptr, weights_ptr, K, ROUTED)
    g = _times_weight(x_ptr + token * D, w1_ptr, s1_ptr, expert, n, n_ok, D, INTER, FP4, FP8,
                      HALVES, SCALE_E8M0, BLOCK_N, EXACT_DOT)
    u = _times_weight(x_ptr + token * D, w3_ptr, s3_ptr, expert, n, n_ok, D, INTER, FP4, FP8,
                      HALVES, SCALE_E8M0, BLOCK_N, EXACT_DOT)
    tl.store(h_ptr + p * INTER + n[None, :],
             weighted_swiglu(g, u, weight, limit, h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def quant_down_kernel(h_ptr, indices_ptr, w2_ptr, s2_ptr, routed_ptr, out_ptr, D, INTER, E,
                      K: tl.constexpr, ROUTED: tl.constexpr, FP4: tl.constexpr,
                      FP8: tl.constexpr, HALVES: tl.constexpr, SCALE_E8M0: tl.constexpr,
                      BLOCK_N: tl.constexpr, EXACT_DOT: tl.constexpr):
    """ROUTED: out[t] = sum over t's pairs in ascending (expert, slot) order of the quantized
    linear's bf16 h[p] w2[e]^T, fp32. Else: out[t] = (routed[t] + bf16(h[t] w2^T)) in out's
    dtype."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    if ROUTED:
        out = tl.zeros([1, BLOCK_N], dtype=tl.float32)
        last = tl.full([], -1, tl.int64)
        for _ in range(K):
            key = next_pair(indices_ptr, t, last, E, K)
            y = _times_weight(h_ptr + (t * K + key % K) * INTER, w2_ptr, s2_ptr, key // K, n,
                              n_ok, INTER, D, FP4, FP8, HALVES, SCALE_E8M0, BLOCK_N, EXACT_DOT)
            out += y.to(tl.bfloat16).to(tl.float32)
            last = key
        tl.store(out_ptr + t * D + n[None, :], out, mask=n_ok[None, :])
    else:
        y = _times_weight(h_ptr + t * INTER, w2_ptr, s2_ptr, 0, n, n_ok, INTER, D, FP4, FP8,
                          HALVES, SCALE_E8M0, BLOCK_N, EXACT_DOT)
        y = (tl.load(routed_ptr + t * D + n[None, :], mask=n_ok[None, :], other=0.0)
             + y.to(tl.bfloat16).to(tl.float32))
        tl.store(out_ptr + t * D + n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=n_ok[None, :])


def _format(fp4: bool, weight: torch.Tensor, scale: torch.Tensor, dialect: str) -> dict:
    """The kernels' format constexprs. FP4: the platform's fp8 rounds the activations (fnuz: on
    half the grid, then doubled); FP8: the weight's dtype is the dialect (fnuz activations
    stored halved with a doubled scale), as `quant_linear_triton` launches them."""
    exact = triton_interpreted()
    if fp4:
        act = DIALECTS[dialect]
        return {"FP4": True, "FP8": fp8_type(act), "HALVES": act is FNUZ, "SCALE_E8M0": True,
                "EXACT_DOT": exact}
    fnuz = weight.dtype == torch.float8_e4m3fnuz
    return {"FP4": False, "FP8": fp8_type(FNUZ if fnuz else OCP), "HALVES": fnuz,
            "SCALE_E8M0": scale.dtype in E8M0_DTYPES,
            "EXACT_DOT": exact}


def _scale_arg(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales as their bytes, other scales as fp32 (as `quant_linear_triton` passes them)."""
    return scale.view(torch.uint8) if scale.dtype in E8M0_DTYPES else scale.float()


def _weight_arg(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.uint8)


def _gate_up(x, indices, weights, w1, w3, s1, s3, limit, rows, k, routed, fmt):
    inter = w1.shape[-2]
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows:
        quant_gate_up_kernel[(rows, triton.cdiv(inter, BLOCK_N))](
            x, indices, weights, _weight_arg(w1), _weight_arg(w3), _scale_arg(s1), _scale_arg(s3),
            h, x.shape[1], inter, limit, K=k, ROUTED=routed, BLOCK_N=BLOCK_N, **fmt,
            **LAUNCH_OPTIONS)
    return h


def moe_routed_fp4_triton(x, weights, indices, w1, w3, w2, s1, s3, s2, swiglu_limit, dialect):
    """`moe_routed` with FP4 experts: w1, w3 [E, inter, D/2], w2 [E, D, inter/2] packed e2m1,
    ue8m0 scales [E, out, in/32]; dialect: the platform's fp8 dialect name."""
    n, d = x.shape
    k = indices.shape[1]
    fmt = _format(True, w1, s1, dialect)
    h = _gate_up(x, indices, weights, w1, w3, s1, s3, swiglu_limit, n * k, k, True, fmt)
    out = torch.empty(n, d, dtype=torch.float32, device=x.device)
    if n:
        quant_down_kernel[(n, triton.cdiv(d, BLOCK_N))](
            h, indices, _weight_arg(w2), _scale_arg(s2), out, out, d, w1.shape[-2], w1.shape[0],
            K=k, ROUTED=True, BLOCK_N=BLOCK_N, **fmt, **LAUNCH_OPTIONS)
    return out


def moe_shared_fp8_triton(routed, x, w1, w3, w2, s1, s3, s2, swiglu_limit):
    """`moe_shared` with an FP8 expert: w1, w3 [inter, D], w2 [D, inter] fp8 with 128x128 block
    scales."""
    n, d = x.shape
    fmt = _format(False, w1, s1, "ocp")
    h = _gate_up(x, x, routed, w1, w3, s1, s3, swiglu_limit, n, 1, False, fmt)
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n:
        quant_down_kernel[(n, triton.cdiv(d, BLOCK_N))](
            h, x, _weight_arg(w2), _scale_arg(s2), routed, out, d, w1.shape[-2], 1, K=1,
            ROUTED=False, BLOCK_N=BLOCK_N, **fmt, **LAUNCH_OPTIONS)
    return out


def moe_routed_triton(x, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale,
                      swiglu_limit, dialect):
    """The moe_routed op's triton backend: FP4 experts (scales given) here, bf16 ones in
    `moe_fused_triton`."""
    if w1_scale is None:
        return moe_routed_bf16_triton(x, weights, indices, w1, w3, w2, swiglu_limit)
    return moe_routed_fp4_triton(x, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale,
                                 swiglu_limit, dialect)


def moe_shared_triton(routed, x, w1, w3, w2, w1_scale, w3_scale, w2_scale, swiglu_limit):
    """The moe_shared op's triton backend: an FP8 expert (scales given) here, a bf16 one in
    `moe_fused_triton`."""
    if w1_scale is None:
        return moe_shared_bf16_triton(routed, x, w1, w3, w2, swiglu_limit)
    return moe_shared_fp8_triton(routed, x, w1, w3, w2, w1_scale, w3_scale, w2_scale,
                                 swiglu_limit)
