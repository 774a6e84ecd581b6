"""The Triton kernels of `moe_fused` (bf16 weights; FP4 / FP8 experts: `moe_fused_quant_triton`).

moe_route: one program per token: the gate's logits over all experts (the D loop in blocks),
the scores, then k rounds of argmax over scores + bias (a biased gate; equal values: the lower
expert) or the token's tid2eid row (a hash gate), the chosen scores renormalised in registers.

moe_routed, two launches and no sort: decode has few (token, expert) pairs, so each pair is a
row of its own. gate_up: one program per (pair, block of inter columns): the token's row times
its expert's w1 and w3 tiles, both rounded to bf16 (as the grouped GEMM's output), the clamped
SwiGLU times the pair's weight, rounded to bf16 -> h [pairs, inter]. down: one program per
(token, block of D columns): the token's k rows of h times their experts' w2 tiles, each
rounded to bf16 and added in ascending (expert, slot) order (the reference's index_add order)
in fp32.

moe_shared, two launches: the same gate_up over the tokens with one expert (weight 1), then a
down that adds the routed sum and rounds to x's dtype.

Sums over D / inter run in Triton's block order, exp / log / division as Triton computes them:
agreement with the reference within a stated tolerance, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kv_row import LAUNCH_OPTIONS

BLOCK_K = 32         # the experts' K blocks (a [BLOCK_N, BLOCK_K] weight tile per load)
BLOCK_N = 32
ROUTE_BLOCK_K = 8    # the gate's: a [next_pow2(E), ROUTE_BLOCK_K] tile per load
SCORE_FUNC_IDS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def _log1p(y):
    """log(1 + y) accurate for small y (softplus of a very negative logit): log(u) * y / (u - 1)
    with u = 1 + y rounded, y itself where u rounds to 1."""
    u = 1.0 + y
    exact = u == 1.0
    return tl.where(exact, y, tl.log(u) * (y / tl.where(exact, 1.0, u - 1.0)))


@triton.jit
def moe_route_kernel(x_ptr, w_ptr, bias_ptr, tid2eid_ptr, ids_ptr, weights_ptr, indices_ptr,
                     D, E, route_scale, K: tl.constexpr, K_PAD: tl.constexpr,
                     SCORE: tl.constexpr, HASH: tl.constexpr, E_PAD: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    e_ok = e < E
    dd = tl.arange(0, BLOCK_K)
    logits = tl.zeros([E_PAD], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_K):
        d = d0 + dd
        xv = tl.load(x_ptr + t * D + d, mask=d < D, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * D + d[None, :],
                    mask=e_ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        logits += tl.sum(w * xv[None, :], axis=1)
    if SCORE == 0:
        z = tl.exp(tl.where(e_ok, logits, float("-inf")) - tl.max(
            tl.where(e_ok, logits, float("-inf")), axis=0))
        scores = z / tl.sum(z, axis=0)
    elif SCORE == 1:
        scores = tl.sigmoid(logits)
    else:
        scores = tl.sqrt(tl.where(logits > 20.0, logits, _log1p(tl.exp(logits))))
    kk = tl.arange(0, K_PAD)
    chosen = tl.zeros([K_PAD], dtype=tl.float32)
    picked = tl.zeros([K_PAD], dtype=tl.int64)
    if HASH:
        token_id = tl.load(ids_ptr + t).to(tl.int64)
        for j in tl.static_range(K):
            ex = tl.load(tid2eid_ptr + token_id * K + j)
            s = tl.sum(tl.where(e == ex, scores, 0.0), axis=0)
            chosen = tl.where(kk == j, s, chosen)
            picked = tl.where(kk == j, ex, picked)
    else:
        key = tl.where(e_ok, scores + tl.load(bias_ptr + e, mask=e_ok, other=0.0),
                       float("-inf"))
        for j in tl.static_range(K):
            best = tl.max(key, axis=0)
            ex = tl.min(tl.where(key == best, e, E_PAD), axis=0)
            s = tl.sum(tl.where(e == ex, scores, 0.0), axis=0)
            chosen = tl.where(kk == j, s, chosen)
            picked = tl.where(kk == j, ex.to(tl.int64), picked)
            key = tl.where(e == ex, float("-inf"), key)
    if SCORE != 0:
        chosen = chosen / tl.sum(chosen, axis=0)
    tl.store(weights_ptr + t * K + kk, chosen * route_scale, mask=kk < K)
    tl.store(indices_ptr + t * K + kk, picked, mask=kk < K)


@triton.jit
def weighted_swiglu(g, u, weight, limit, OUT: tl.constexpr):
    """OUT(weight * silu(min(OUT(g), limit)) * clamp(OUT(u), +-limit)) of the fp32 gate and up
    sums, each rounded to OUT first as the GEMMs' outputs are (no clamp when limit <= 0)."""
    gate = g.to(OUT).to(tl.float32)
    up = u.to(OUT).to(tl.float32)
    if limit > 0:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return (weight * (gate * tl.sigmoid(gate) * up)).to(OUT)


@triton.jit
def pair_of(p, indices_ptr, weights_ptr, K: tl.constexpr, ROUTED: tl.constexpr):
    """(token row, expert, routing weight) of gate/up program p: with ROUTED the pair p of
    token p // K, else row p of the shared expert (expert 0, weight 1)."""
    if ROUTED:
        token, expert, weight = p // K, tl.load(indices_ptr + p), tl.load(weights_ptr + p)
    else:
        token, expert, weight = p, 0, 1.0
    return token, expert, weight


@triton.jit
def next_pair(indices_ptr, t, last, E, K: tl.constexpr):
    """Token t's smallest (expert, slot) key (expert * K + slot) above `last`: its pairs one by
    one in the reference's index_add order."""
    key = E * K
    for j in tl.static_range(K):
        kj = tl.load(indices_ptr + t * K + j) * K + j
        key = tl.where((kj > last) & (kj < key), kj, key)
    return key


@triton.jit
def gate_up_kernel(x_ptr, indices_ptr, weights_ptr, w1_ptr, w3_ptr, h_ptr, D, INTER, limit,
                   K: tl.constexpr, ROUTED: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """h[p] = bf16(weight * silu(min(bf16(x w1^T), limit)) * clamp(bf16(x w3^T), +-limit))."""
    p = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    token, expert, weight = pair_of(p, indices_ptr, weights_ptr, K, ROUTED)
    dd = tl.arange(0, BLOCK_K)
    base = expert * INTER * D + n[:, None].to(tl.int64) * D
    g = tl.zeros([BLOCK_N], dtype=tl.float32)
    u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_K):
        d = d0 + dd
        ok = n_ok[:, None] & (d < D)[None, :]
        xv = tl.load(x_ptr + token * D + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
        g += tl.sum(tl.load(w1_ptr + base + d[None, :], mask=ok, other=0.0).to(tl.float32)
                    * xv, axis=1)
        u += tl.sum(tl.load(w3_ptr + base + d[None, :], mask=ok, other=0.0).to(tl.float32)
                    * xv, axis=1)
    tl.store(h_ptr + p * INTER + n, weighted_swiglu(g, u, weight, limit, h_ptr.dtype.element_ty),
             mask=n_ok)


@triton.jit
def _row_times_w2(h_row, w2, n, n_ok, INTER, BLOCK_K: tl.constexpr):
    """bf16(h_row . w2[n, :]) for the columns n: [BLOCK_N] fp32."""
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros(n.shape, dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k = k0 + kk
        hv = tl.load(h_row + k, mask=k < INTER, other=0.0)
        w = tl.load(w2 + n[:, None].to(tl.int64) * INTER + k[None, :],
                    mask=n_ok[:, None] & (k < INTER)[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * hv.to(tl.float32)[None, :], axis=1)
    return acc.to(h_row.dtype.element_ty).to(tl.float32)


@triton.jit
def down_kernel(h_ptr, indices_ptr, w2_ptr, routed_ptr, out_ptr, D, INTER, E,
                K: tl.constexpr, ROUTED: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """ROUTED: out[t] = sum over t's pairs in ascending expert order of bf16(h[p] w2[e]^T), fp32.
    Else (the shared expert): out[t] = (routed[t] + bf16(h[t] w2^T)) in out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    if ROUTED:
        out = tl.zeros([BLOCK_N], dtype=tl.float32)
        last = -1
        for _ in tl.static_range(K):
            key = next_pair(indices_ptr, t, last, E, K)
            p = t * K + key % K
            out += _row_times_w2(h_ptr + p * INTER, w2_ptr + (key // K) * D * INTER, n, n_ok,
                                 INTER, BLOCK_K)
            last = key
        tl.store(out_ptr + t * D + n, out, mask=n_ok)
    else:
        y = tl.load(routed_ptr + t * D + n, mask=n_ok, other=0.0) + _row_times_w2(
            h_ptr + t * INTER, w2_ptr, n, n_ok, INTER, BLOCK_K)
        tl.store(out_ptr + t * D + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def moe_route_triton(x, gate_weight, bias, tid2eid, input_ids, k, route_scale, score_func):
    n, d = x.shape
    e = gate_weight.shape[0]
    weights = torch.empty(n, k, dtype=torch.float32, device=x.device)
    indices = torch.empty(n, k, dtype=torch.int64, device=x.device)
    if n:
        hash_gate = tid2eid is not None
        moe_route_kernel[(n,)](x, gate_weight, x if hash_gate else bias,
                               tid2eid if hash_gate else indices,
                               input_ids if hash_gate else indices, weights, indices, d, e,
                               route_scale, K=k, K_PAD=triton.next_power_of_2(k),
                               SCORE=SCORE_FUNC_IDS[score_func],
                               HASH=hash_gate, E_PAD=triton.next_power_of_2(e),
                               BLOCK_K=ROUTE_BLOCK_K, **LAUNCH_OPTIONS)
    return weights, indices


def _gate_up(x, indices, weights, w1, w3, limit, rows, k, routed):
    inter = w1.shape[-2]
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows:
        gate_up_kernel[(rows, triton.cdiv(inter, BLOCK_N))](
            x, indices, weights, w1, w3, h, x.shape[1], inter, limit, K=k, ROUTED=routed,
            BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, **LAUNCH_OPTIONS)
    return h


def moe_routed_bf16_triton(x, weights, indices, w1, w3, w2, swiglu_limit):
    """`moe_routed` with bf16 experts."""
    n, d = x.shape
    k = indices.shape[1]
    h = _gate_up(x, indices, weights, w1, w3, swiglu_limit, n * k, k, True)
    out = torch.empty(n, d, dtype=torch.float32, device=x.device)
    if n:
        down_kernel[(n, triton.cdiv(d, BLOCK_N))](h, indices, w2, out, out, d, w1.shape[-2],
                                                  w1.shape[0], K=k, ROUTED=True,
                                                  BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N,
                                                  **LAUNCH_OPTIONS)
    return out


def moe_shared_bf16_triton(routed, x, w1, w3, w2, swiglu_limit):
    """`moe_shared` with a bf16 expert."""
    n, d = x.shape
    h = _gate_up(x, x, routed, w1, w3, swiglu_limit, n, 1, False)
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n:
        down_kernel[(n, triton.cdiv(d, BLOCK_N))](h, x, w2, routed, out, d, w1.shape[-2], 1,
                                                  K=1, ROUTED=False, BLOCK_K=BLOCK_K,
                                                  BLOCK_N=BLOCK_N, **LAUNCH_OPTIONS)
    return out
