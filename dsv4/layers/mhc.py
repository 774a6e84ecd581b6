"""Manifold-constrained hyper-connections (mHC): the hidden state carries hc_mult copies.

``hc_pre`` mixes the copies into one block input and returns the ``post`` / ``comb`` weights that
``hc_post`` uses to write the block output back; ``comb`` is made doubly stochastic by Sinkhorn
iterations. ``hc_head`` is the final reduction (pre weights only). Shapes: x [N, hc, D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hip_kernels import KernelOptions, mhc_split


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """(x.flatten @ fn^T) * rsqrt(mean(x^2) + eps), fp32 [N, fn.shape[0]]."""
    xf = x.flatten(-2).float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(xf, fn.float()) * r


def hc_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
             eps: float, *, reference: bool, options: KernelOptions
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre [N, hc], post [N, hc], comb [N, hc, hc] (Sinkhorn-normalised) from the mixes
    [N, (2 + hc) * hc]: one fused op (``hip_kernels.mhc_split``; reference: the reference
    numerics' Sinkhorn; options: the kernel options)."""
    return mhc_split.hc_split(mixes.flatten(0, -2), scale, base, hc, iters, eps,
                              reference=reference, options=options)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, iters: int, hc_eps: float, *, reference: bool,
           options: KernelOptions):
    """Block input y [N, D] (x's dtype) and the (post, comb) weights for hc_post."""
    pre, post, comb = hc_split(hc_mixes(x, fn, norm_eps), scale, base, x.shape[-2], iters, hc_eps,
                               reference=reference, options=options)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2)
    return y.to(x.dtype), post, comb


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """X'_j = post_j * out + sum_i comb[i, j] * X_i, in out's dtype."""
    mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(out.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """Final reduction of the copies: sum_i (sigmoid(mix_i * scale + base_i) + eps) * X_i."""
    pre = torch.sigmoid(hc_mixes(x, fn, norm_eps) * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
