"""The Triton kernel of `plain_linear`: one program per (block of BLOCK_N rows, block of BLOCK_R
outputs), walking K in BLOCK_K columns with an fp32 accumulator and one rounding at the end. On
a GPU a bf16/fp16 x runs the dot on the matrix cores in its dtype (exact products, fp32 sums);
the interpreter's bf16 dot is wrong, so there the same values go through an IEEE fp32 dot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .platform import triton_interpreted

BLOCK_N = 16      # tl.dot's smallest M: a decode step's few rows
BLOCK_R = 16
BLOCK_K = 64
LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def plain_linear_kernel(x_ptr, w_ptr, out_ptr, n_rows, K, R, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_NATIVE: tl.constexpr):
    row = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_ok = (row < n_rows)[:, None]
    r_ok = (r < R)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        k_ok = k < K
        x = tl.load(x_ptr + row[:, None] * K + k, mask=row_ok & k_ok, other=0.0)
        w = tl.load(w_ptr + r[:, None] * K + k, mask=r_ok & k_ok, other=0.0)
        if DOT_NATIVE:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
    out = out_ptr + row[:, None] * R + r[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (r < R)[None, :])


def plain_linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The op's triton backend (checked, contiguous arguments; see `plain_linear`)."""
    n, k = x.shape
    rows = weight.shape[0]
    out = torch.empty(n, rows, dtype=x.dtype, device=x.device)
    if n and rows:
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(rows, BLOCK_R))
        plain_linear_kernel[grid](x, weight, out, n, k, rows, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
                                  BLOCK_K=BLOCK_K,
                                  DOT_NATIVE=x.dtype != torch.float32 and not triton_interpreted(),
                                  **LAUNCH_OPTIONS)
    return out
