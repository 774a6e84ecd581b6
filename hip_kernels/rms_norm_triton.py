"""The Triton kernel of `rms_norm`: one program per row, the row held in registers (D padded to
a power of two), fp32 statistics, one rounding to the output dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kv_row import LAUNCH_OPTIONS


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, width, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    live = d < width
    x = tl.load(x_ptr + row * width + d, mask=live, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    w = tl.load(w_ptr + d, mask=live, other=0.0)
    tl.store(y_ptr + row * width + d, (w * (x * r)).to(y_ptr.dtype.element_ty), mask=live)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty_like(x)
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if rows:
        rms_norm_kernel[(rows,)](x, weight, y, width, eps, BLOCK_D=triton.next_power_of_2(width),
                                 **LAUNCH_OPTIONS)
    return y
