"""mHC pre (with the RMSNorm after it), mHC post and the mHC head (with the final RMSNorm after
it), each as one dispatcher op (`torch.ops.dsv4.hc_pre`, `torch.ops.dsv4.hc_post`,
`torch.ops.dsv4.hc_head`). x is the hidden state's hc copies [N, hc, D].

    hc_pre:  mixes = (x.flatten @ fn^T) * rsqrt(mean(x^2) + mix_eps)      fp32 [N, (2 + hc) hc]
             pre, post, comb = the split of the mixes (`mhc_split`, Sinkhorn on comb)
             y = sum_i pre_i * x_i, rounded to x's dtype
             out = norm_weight * y * rsqrt(mean(y^2) + norm_eps), in x's dtype (the block's
             attn_norm / ffn_norm; y itself without a norm_weight) -> (out [N, D], post, comb)
    hc_post: X'_j = post_j * out + sum_i comb[i, j] * X_i, in out's dtype
    hc_head: the model's final reduction of the copies: mixes as hc_pre's with fn's hc rows,
             pre = sigmoid(mixes * scale + base) + hc_eps, y and the norm as hc_pre's (the
             model's final norm) -> out [N, D]

The torch references are the model's code before the fusion, op for op, so the reference
numerics keep their bits. The Triton kernels (`mhc_fused_triton`) compute in fp32 in the same
order with one rounding where the reference rounds, but sum in their own order (the mixes' dot,
the norms' means) and compute exp / division as Triton does: they agree with the reference to a
stated tolerance, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import resolve
from .checks import check_kernel, check_tensor
from .library import define_op, op
from .mhc_split import hc_split_ref
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions

HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """(x.flatten @ fn^T) * rsqrt(mean(x^2) + eps), fp32 [N, fn.shape[0]]."""
    xf = x.flatten(-2).float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return F.linear(xf, fn.float()) * r


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim, statistics in fp32, in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


def hc_pre_ref(x, fn, scale, base, norm_weight, mix_eps, iters, hc_eps, norm_eps, reference):
    pre, post, comb = hc_split_ref(hc_mixes(x, fn, mix_eps).contiguous(), scale.float(),
                                   base.float(), x.shape[-2], iters, hc_eps, reference)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
    if norm_weight is None:
        return y, post, comb
    return rms_norm_ref(y, norm_weight, norm_eps), post, comb


def hc_post_ref(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
    mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(out.dtype)


def hc_head_ref(x, fn, scale, base, norm_weight, mix_eps, hc_eps, norm_eps):
    pre = torch.sigmoid(hc_mixes(x, fn, mix_eps) * scale + base) + hc_eps
    y = (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
    if norm_weight is None:
        return y
    return rms_norm_ref(y, norm_weight, norm_eps)


def _pre_fake(x, fn, scale, base, norm_weight, *rest):
    n, hc, d = x.shape
    f32 = torch.float32
    return x.new_empty(n, d), x.new_empty(n, hc, dtype=f32), x.new_empty(n, hc, hc, dtype=f32)


def _post_fake(out, residual, post, comb):
    return residual.new_empty(residual.shape, dtype=out.dtype)


def _head_fake(x, *rest):
    return x.new_empty(x.shape[0], x.shape[2])


define_op("hc_pre", "(Tensor x, Tensor fn, Tensor scale, Tensor base, Tensor? norm_weight, "
          "float mix_eps, int iters, float hc_eps, float norm_eps, bool reference) "
          "-> (Tensor, Tensor, Tensor)", hc_pre_ref, _pre_fake,
          triton="mhc_fused_triton.hc_pre_triton")
define_op("hc_post", "(Tensor out, Tensor residual, Tensor post, Tensor comb) -> Tensor",
          hc_post_ref, _post_fake, triton="mhc_fused_triton.hc_post_triton")
define_op("hc_head", "(Tensor x, Tensor fn, Tensor scale, Tensor base, Tensor? norm_weight, "
          "float mix_eps, float hc_eps, float norm_eps) -> Tensor", hc_head_ref, _head_fake,
          triton="mhc_fused_triton.hc_head_triton")


def _is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_weight: torch.Tensor | None, *, mix_eps: float, iters: int, hc_eps: float,
           norm_eps: float, reference: bool = True,
           kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre and the RMSNorm after it: (normed block input [N, D] in x's dtype, post fp32
    [N, hc], comb fp32 [N, hc, hc]) from x [N, hc, D]; fn [(2 + hc) hc, hc D], scale [3],
    base [(2 + hc) hc], norm_weight [D] (None: no norm, y itself) with its eps norm_eps (no
    default: a norm's eps is the model's; unused without norm_weight). reference: DeepSeek-V4's
    reference numerics (the Sinkhorn's softmax, see `mhc_split`). kernel.backend picks the
    backend (no HIP version); an hc that is not a power of two runs the torch reference."""
    check_kernel(kernel)
    if not isinstance(reference, bool):
        raise TypeError(f"reference must be a bool, got {reference!r}")
    check_tensor("x", x, dtypes=HIDDEN_DTYPES, dim=3)
    n, hc, d = x.shape
    width = (2 + hc) * hc
    check_tensor("fn", fn, shape=(width, hc * d), device=x.device)
    check_tensor("scale", scale, shape=(3,), device=x.device)
    check_tensor("base", base, shape=(width,), device=x.device)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(d,), device=x.device)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    backend = resolve("hc_pre", x.device, kernel.backend, triton_ok=_is_pow2(hc))
    return op("hc_pre", backend)(x.contiguous(), fn.contiguous(), scale, base, norm_weight,
                                 float(mix_eps), iters, float(hc_eps), float(norm_eps), reference)


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            *, kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """mHC post: [N, hc, D] in out's dtype, X'_j = post_j * out + sum_i comb[i, j] * X_i, from
    the block output out [N, D], the residual copies [N, hc, D] and hc_pre's post fp32 [N, hc]
    and comb fp32 [N, hc, hc]."""
    check_kernel(kernel)
    check_tensor("residual", residual, dtypes=HIDDEN_DTYPES, dim=3)
    n, hc, d = residual.shape
    check_tensor("out", out, dtypes=HIDDEN_DTYPES, shape=(n, d), device=residual.device)
    check_tensor("post", post, dtype=torch.float32, shape=(n, hc), device=residual.device)
    check_tensor("comb", comb, dtype=torch.float32, shape=(n, hc, hc), device=residual.device)
    backend = resolve("hc_post", residual.device, kernel.backend, triton_ok=_is_pow2(hc))
    return op("hc_post", backend)(out.contiguous(), residual.contiguous(), post.contiguous(),
                                  comb.contiguous())


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_weight: torch.Tensor | None, *, mix_eps: float, hc_eps: float, norm_eps: float,
            kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """The mHC head and the final RMSNorm after it: [N, D] in x's dtype from x [N, hc, D], the
    head's fn [hc, hc D], scale [1], base [hc] and norm_weight [D] (None: no norm, the weighted
    sum itself) with its eps norm_eps (no default: the norm's eps is the model's; unused
    without norm_weight). kernel.backend picks the backend (no HIP version); an hc that is not
    a power of two runs the torch reference."""
    check_kernel(kernel)
    check_tensor("x", x, dtypes=HIDDEN_DTYPES, dim=3)
    n, hc, d = x.shape
    check_tensor("fn", fn, shape=(hc, hc * d), device=x.device)
    check_tensor("scale", scale, shape=(1,), device=x.device)
    check_tensor("base", base, shape=(hc,), device=x.device)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(d,), device=x.device)
    backend = resolve("hc_head", x.device, kernel.backend, triton_ok=_is_pow2(hc))
    return op("hc_head", backend)(x.contiguous(), fn.contiguous(), scale, base, norm_weight,
                                  float(mix_eps), float(hc_eps), float(norm_eps))
