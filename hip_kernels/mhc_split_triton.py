"""The Triton kernel of `mhc_split`: one program per BLOCK_N rows, the [hc, hc] comb of each row
held in registers through every Sinkhorn iteration (one launch per call)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kv_row import LAUNCH_OPTIONS

BLOCK_N = 16


@triton.jit
def hc_split_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, n_rows, iters,
                    eps, HC: tl.constexpr, BLOCK_N: tl.constexpr):
    WIDTH: tl.constexpr = (2 + HC) * HC
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n_rows
    k = tl.arange(0, HC)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)

    row_mix = mix_ptr + rows[:, None].to(tl.int64) * WIDTH
    pre = tl.load(row_mix + k[None, :], mask=live[:, None], other=0.0)
    pre = tl.sigmoid(pre * s0 + tl.load(base_ptr + k)[None, :]) + eps
    post = tl.load(row_mix + HC + k[None, :], mask=live[:, None], other=0.0)
    post = 2.0 * tl.sigmoid(post * s1 + tl.load(base_ptr + HC + k)[None, :])
    out = rows[:, None].to(tl.int64) * HC + k[None, :]
    tl.store(pre_ptr + out, pre, mask=live[:, None])
    tl.store(post_ptr + out, post, mask=live[:, None])

    ij = k[:, None] * HC + k[None, :]                                  # [HC, HC]
    c = tl.load(row_mix[:, :, None] + 2 * HC + ij[None, :, :], mask=live[:, None, None],
                other=0.0)
    c = c * s2 + tl.load(base_ptr + 2 * HC + ij)[None, :, :]
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    tl.store(comb_ptr + rows[:, None, None].to(tl.int64) * (HC * HC) + ij[None, :, :], c,
             mask=live[:, None, None])


def hc_split_triton(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                    iters: int, eps: float, reference: bool):
    """The op's triton backend. reference changes nothing here: the kernel's softmax is the true
    division in both numerics (see `mhc_split.sinkhorn_ref`)."""
    n = mixes.shape[0]
    pre = torch.empty(n, hc, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=mixes.device)
    if n:
        hc_split_kernel[(triton.cdiv(n, BLOCK_N),)](
            mixes, scale, base, pre, post, comb, n, iters, eps, HC=hc, BLOCK_N=BLOCK_N,
            **LAUNCH_OPTIONS)
    return pre, post, comb
