"""mHC's split of the mixes into (pre, post, comb), with comb's Sinkhorn normalisation, as one
dispatcher op (`torch.ops.dsv4.hc_split`).

For each row of mixes [N, (2 + hc) * hc] (fp32), with scale [3] and base [(2 + hc) * hc]:

    pre  = sigmoid(mixes[:hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(mixes[hc:2hc] * scale[1] + base[hc:2hc])
    comb = mixes[2hc:] * scale[2] + base[2hc:] as [hc, hc]; c = softmax over j + eps; c /= its
           column sums + eps; then iters - 1 times: c /= row sums + eps, c /= column sums + eps

The torch reference runs these as ~120 small ops per call (the loop is sequential); the Triton
kernel (`mhc_split_triton`, one program per block of rows, everything in registers) runs them
as one launch. Both compute in fp32 in the same order; exp and division may differ in the last
bit between torch and Triton, so they agree to ~1e-6 relative, not bit for bit. `reference`
(DeepSeek-V4's reference numerics) is an argument of the op, so a recorded call replays the same
math.
"""

from __future__ import annotations

import torch

from .backend import resolve
from .checks import check_kernel
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions

OP = "hc_split"


def sinkhorn_ref(comb: torch.Tensor, iters: int, eps: float, reference: bool) -> torch.Tensor:
    """Row softmax, then alternate column / row normalisation, ending on the columns. With
    reference (numerics) the softmax is written out, exp(c - max) / sum, a true division as
    the reference (and the Triton kernel) computes it; fp32 keeps torch's softmax, which
    multiplies by the reciprocal (about a quarter of values 1 ulp apart)."""
    if reference:
        e = torch.exp(comb - comb.amax(-1, keepdim=True))
        c = e / e.sum(-1, keepdim=True) + eps
    else:
        c = comb.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_split_ref(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                 iters: int, eps: float,
                 reference: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mixes[..., 2 * hc:].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc)
    return pre, post, sinkhorn_ref(comb, iters, eps, reference)


def _fake(mixes, scale, base, hc, iters, eps, reference):
    n = mixes.shape[0]
    return (mixes.new_empty(n, hc), mixes.new_empty(n, hc), mixes.new_empty(n, hc, hc))


define_op(OP, "(Tensor mixes, Tensor scale, Tensor base, int hc, int iters, float eps, "
          "bool reference) -> (Tensor, Tensor, Tensor)", hc_split_ref, _fake,
          triton="mhc_split_triton.hc_split_triton")


def hc_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
             eps: float, *, reference: bool = True,
             kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [N, hc], post [N, hc], comb [N, hc, hc]) fp32 from fp32 mixes [N, (2 + hc) * hc].
    reference: DeepSeek-V4's reference numerics (see `sinkhorn_ref`). kernel.backend picks the
    backend (no HIP version: hip runs Triton where it can); an hc that is not a power of two
    (Triton block shapes must be) runs the torch reference."""
    check_kernel(kernel)
    if not isinstance(reference, bool):
        raise TypeError(f"reference must be a bool, got {reference!r}")
    width = (2 + hc) * hc
    if mixes.dim() != 2 or mixes.shape[1] != width or mixes.dtype != torch.float32:
        raise ValueError(f"mixes must be fp32 [N, {width}] for hc={hc}, got {mixes.dtype} "
                         f"{tuple(mixes.shape)}")
    if tuple(scale.shape) != (3,) or tuple(base.shape) != (width,):
        raise ValueError(f"scale must be [3] and base [{width}], got {tuple(scale.shape)} and "
                         f"{tuple(base.shape)}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    backend = resolve(OP, mixes.device, kernel.backend, triton_ok=not hc & (hc - 1))
    return op(OP, backend)(mixes.contiguous(), scale.float(), base.float(), hc, iters, float(eps),
                           reference)
