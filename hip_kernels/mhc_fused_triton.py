"""The Triton kernels of `mhc_fused`, one launch per call each.

hc_pre: one program per row (token). It streams the row's hc * D values once against fn's
(2 + hc) hc rows for the mixes (pre, post and comb parts kept in their own accumulators, so
the split needs no register shuffles), runs the split and the Sinkhorn in registers (as
`mhc_split_triton`), then walks D twice: the first pass sums the squares of the weighted sum y
(rounded to x's dtype, as the reference rounds it) for the norm, the second recomputes y from x
(cheaper than a store + barrier + reload) and stores weight * y * rsqrt(mean(y^2) + eps).

hc_head: one program per row, as hc_pre with the mixes' pre part only (fn's hc rows, one scale)
and the model's final norm in place of the block's.

hc_post: one program per (row, block of D columns): comb [hc, hc] applied to the residual
tile [hc, BLOCK_D], plus post_j * out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kv_row import LAUNCH_OPTIONS

BLOCK_D = 32        # hc_pre's row blocks (its mixes hold (2 + hc) hc accumulators of this width)
POST_BLOCK_D = 128
HEAD_BLOCK_D = 128  # hc_head's (its mixes hold hc accumulators)


@triton.jit
def _sinkhorn(c, iters, eps):
    """[HC, HC] comb logits -> row softmax + eps, then column / row normalisations ending on
    the columns (the reference's order)."""
    c = tl.exp(c - tl.max(c, axis=1)[:, None])
    c = c / tl.sum(c, axis=1)[:, None] + eps
    c = c / (tl.sum(c, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + eps)
        c = c / (tl.sum(c, axis=0)[None, :] + eps)
    return c


@triton.jit
def _weighted_sum_store(x_row, pre, w_ptr, out_row, D, norm_eps, HC: tl.constexpr,
                        NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """y = sum_i pre_i * x_i over the row's copies x_row [HC, D], rounded to out's dtype;
    with NORM stored as w * y * rsqrt(mean(y^2) + norm_eps) (the first pass sums y's squares,
    the second recomputes y from x: cheaper than a store + barrier + reload)."""
    i = tl.arange(0, HC)
    dd = tl.arange(0, BLOCK_D)
    OUT: tl.constexpr = out_row.dtype.element_ty
    r_norm = 1.0
    if NORM:
        y_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + dd
            xt = tl.load(x_row + i[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0)
            y = tl.sum(pre[:, None] * xt.to(tl.float32), axis=0).to(OUT).to(tl.float32)
            y_sq += y * y
        r_norm = 1.0 / tl.sqrt(tl.sum(y_sq, axis=0) / D + norm_eps)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        d_ok = d < D
        xt = tl.load(x_row + i[:, None] * D + d[None, :], mask=d_ok[None, :], other=0.0)
        y = tl.sum(pre[:, None] * xt.to(tl.float32), axis=0).to(OUT)
        if NORM:
            w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
            y = (w * (y.to(tl.float32) * r_norm)).to(OUT)
        tl.store(out_row + d, y, mask=d_ok)


@triton.jit
def hc_pre_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, w_ptr, out_ptr, post_ptr, comb_ptr, D,
                  mix_eps, iters, hc_eps, norm_eps, HC: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    K = HC * D
    i = tl.arange(0, HC)
    ij = i[:, None] * HC + i[None, :]
    dd = tl.arange(0, BLOCK_D)
    x_row = x_ptr + row * K

    acc_pre = tl.zeros([HC, BLOCK_D], dtype=tl.float32)
    acc_post = tl.zeros([HC, BLOCK_D], dtype=tl.float32)
    acc_comb = tl.zeros([HC, HC, BLOCK_D], dtype=tl.float32)
    sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_D):
        k = k0 + dd
        k_ok = k < K
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        sq += xv * xv
        f = tl.load(fn_ptr + i[:, None].to(tl.int64) * K + k[None, :], mask=k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc_pre += f * xv[None, :]
        f = tl.load(fn_ptr + (HC + i[:, None]).to(tl.int64) * K + k[None, :],
                    mask=k_ok[None, :], other=0.0).to(tl.float32)
        acc_post += f * xv[None, :]
        f = tl.load(fn_ptr + (2 * HC + ij[:, :, None]).to(tl.int64) * K + k[None, None, :],
                    mask=k_ok[None, None, :], other=0.0).to(tl.float32)
        acc_comb += f * xv[None, None, :]
    r = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + mix_eps)

    pre = tl.sigmoid(tl.sum(acc_pre, axis=1) * r * tl.load(scale_ptr)
                     + tl.load(base_ptr + i)) + hc_eps
    post = 2.0 * tl.sigmoid(tl.sum(acc_post, axis=1) * r * tl.load(scale_ptr + 1)
                            + tl.load(base_ptr + HC + i))
    c = tl.sum(acc_comb, axis=2) * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + ij)
    tl.store(post_ptr + row * HC + i, post)
    tl.store(comb_ptr + row * HC * HC + ij, _sinkhorn(c, iters, hc_eps))
    _weighted_sum_store(x_row, pre, w_ptr, out_ptr + row * D, D, norm_eps, HC=HC, NORM=NORM,
                        BLOCK_D=BLOCK_D)


@triton.jit
def hc_head_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, w_ptr, out_ptr, D, mix_eps, hc_eps,
                   norm_eps, HC: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    K = HC * D
    i = tl.arange(0, HC)
    dd = tl.arange(0, BLOCK_D)
    x_row = x_ptr + row * K

    acc = tl.zeros([HC, BLOCK_D], dtype=tl.float32)
    sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_D):
        k = k0 + dd
        k_ok = k < K
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        sq += xv * xv
        f = tl.load(fn_ptr + i[:, None].to(tl.int64) * K + k[None, :], mask=k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += f * xv[None, :]
    r = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + mix_eps)
    pre = tl.sigmoid(tl.sum(acc, axis=1) * r * tl.load(scale_ptr) + tl.load(base_ptr + i)) + hc_eps
    _weighted_sum_store(x_row, pre, w_ptr, out_ptr + row * D, D, norm_eps, HC=HC, NORM=NORM,
                        BLOCK_D=BLOCK_D)


@triton.jit
def hc_post_kernel(out_ptr, res_ptr, post_ptr, comb_ptr, y_ptr, D, HC: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    i = tl.arange(0, HC)
    res = tl.load(res_ptr + row * HC * D + i[:, None] * D + d[None, :], mask=d_ok[None, :],
                  other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + row * HC * HC + i[:, None] * HC + i[None, :])     # [i, j]
    mixed = tl.sum(comb[:, :, None] * res[:, None, :], axis=0)                  # [j, d]
    out = tl.load(out_ptr + row * D + d, mask=d_ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + row * HC + i)
    y = post[:, None] * out[None, :] + mixed
    tl.store(y_ptr + row * HC * D + i[:, None] * D + d[None, :],
             y.to(y_ptr.dtype.element_ty), mask=d_ok[None, :])


def hc_pre_triton(x, fn, scale, base, norm_weight, mix_eps, iters, hc_eps, norm_eps, reference):
    """The op's triton backend. reference changes nothing here: the split's softmax is the true
    division in both numerics, as `hc_split`'s kernel."""
    n, hc, d = x.shape
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    post = torch.empty(n, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=x.device)
    if n:
        norm = norm_weight is not None
        hc_pre_kernel[(n,)](x, fn, scale.float(), base.float(), norm_weight if norm else x, out,
                            post, comb, d, mix_eps, iters, hc_eps, norm_eps, HC=hc, NORM=norm,
                            BLOCK_D=BLOCK_D, **LAUNCH_OPTIONS)
    return out, post, comb


def hc_post_triton(out, residual, post, comb):
    n, hc, d = residual.shape
    y = torch.empty(n, hc, d, dtype=out.dtype, device=out.device)
    if n:
        hc_post_kernel[(n, triton.cdiv(d, POST_BLOCK_D))](out, residual, post, comb, y, d, HC=hc,
                                                          BLOCK_D=POST_BLOCK_D, **LAUNCH_OPTIONS)
    return y


def hc_head_triton(x, fn, scale, base, norm_weight, mix_eps, hc_eps, norm_eps):
    n, hc, d = x.shape
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n:
        norm = norm_weight is not None
        hc_head_kernel[(n,)](x, fn, scale.float(), base.float(), norm_weight if norm else x, out,
                             d, mix_eps, hc_eps, norm_eps, HC=hc, NORM=norm,
                             BLOCK_D=HEAD_BLOCK_D, **LAUNCH_OPTIONS)
    return out
