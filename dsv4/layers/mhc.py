"""Manifold-constrained hyper-connections (mHC): the hidden state carries hc_mult copies.

``hc_pre`` mixes the copies into one block input (normed by the block's RMSNorm when given its
weight) and returns the ``post`` / ``comb`` weights that ``hc_post`` uses to write the block
output back; ``comb`` is made doubly stochastic by Sinkhorn iterations. ``hc_head`` is the final
reduction (pre weights only) with the model's final RMSNorm after it. Each is one
dispatcher op (``hip_kernels.mhc_fused``). Shapes: x [N, hc, D].
"""

from __future__ import annotations

import torch

from hip_kernels import DEFAULT_KERNEL_OPTIONS, KernelOptions, mhc_fused


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, iters: int, hc_eps: float, *, reference: bool,
           kernel: KernelOptions, norm=None):
    """Block input y [N, D] (x's dtype) and the (post, comb) weights for hc_post; norm (an
    ``RMSNorm``, the block's attn_norm / ffn_norm): y comes out normed by it, in the same op;
    reference: the reference numerics' Sinkhorn; kernel: the kernel options."""
    return mhc_fused.hc_pre(x, fn, scale, base, None if norm is None else norm.weight,
                            mix_eps=norm_eps, iters=iters, hc_eps=hc_eps,
                            norm_eps=0.0 if norm is None else norm.eps, reference=reference,
                            kernel=kernel)


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """X'_j = post_j * out + sum_i comb[i, j] * X_i, in out's dtype."""
    return mhc_fused.hc_post(out, residual, post, comb, kernel=kernel)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float, *, norm, kernel: KernelOptions) -> torch.Tensor:
    """Final reduction of the copies, y = sum_i (sigmoid(mix_i * scale + base_i) + eps) * X_i in
    x's dtype, normed by norm (an ``RMSNorm``, the model's final norm) in the same op; kernel:
    the kernel options."""
    return mhc_fused.hc_head(x, fn, scale, base, norm.weight, mix_eps=norm_eps, hc_eps=hc_eps,
                             norm_eps=norm.eps, kernel=kernel)
