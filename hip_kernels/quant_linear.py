"""DeepSeek-V4's quantized linears as dispatcher ops: the activation quantization (the reference's
`act_quant`) and the block-scaled GEMM in one call.

    fp8_linear(x, weight, weight_scale[, out_dtype])    -> torch.ops.dsv4.fp8_linear
    fp8_grouped_linear(x, weight, weight_scale, offs)   -> torch.ops.dsv4.fp8_grouped_linear
    fp4_grouped_linear(x, weight, weight_scale, offs)   -> torch.ops.dsv4.fp4_grouped_linear

x is bf16 [P, K] with K a multiple of 128; each row is quantized per 128-wide block (ue8m0
power-of-two scales by default, `scale_fmt=None` for the plain amax / 448), then multiplied with
the weight as the reference's fp8_gemm / fp4_gemm do (see `quant_linear_ref` for the exact
semantics and what a GPU may round differently). The grouped ops run the routed experts: rows
sorted by expert, offs int32 [E] the cumulative end row of each expert's group (the convention of
`torch._grouped_mm`); rows past offs[-1] come out 0.

The torch path (`quant_linear_ref`) is the CPU path and the tests' oracle (its grouped ops read
offs on the host and loop over the experts: not for graph capture); the Triton kernels
(`quant_linear_triton`) fuse the quantization into the GEMM and read offs on the device. The FP8 weight's dtype picks the
dialect: float8_e4m3fn as published, float8_e4m3fnuz after `ocp_to_fnuz` (MI300); an e4m3fn
weight on an fnuz platform runs the torch path (convert it at load).
"""

from __future__ import annotations

import torch

from .backend import resolve
from .checks import check_kernel, check_tensor, value_checks_enabled
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from .platform import FNUZ
from .quant_linear_ref import (ACT_BLOCK, FP4_BLOCK, SCALE_FORMATS, fp4_grouped_linear_ref,
                               fp8_grouped_linear_ref, fp8_linear_ref)

FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP8_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e8m0fnu, torch.uint8)
FP4_WEIGHT_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
FP4_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
FP8_LINEAR_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _fake(x, weight, weight_scale, *rest):
    return x.new_empty(x.shape[0], weight.shape[-2], dtype=torch.bfloat16)


def _fp8_linear_fake(x, weight, weight_scale, round_scale, out_dtype):
    return x.new_empty(x.shape[0], weight.shape[-2], dtype=out_dtype)


WEIGHTS = "Tensor x, Tensor weight, Tensor weight_scale"
define_op("fp8_linear", f"({WEIGHTS}, bool round_scale, ScalarType out_dtype) -> Tensor",
          fp8_linear_ref, _fp8_linear_fake, triton="quant_linear_triton.fp8_linear_triton")
define_op("fp8_grouped_linear", f"({WEIGHTS}, Tensor offs, bool round_scale) -> Tensor",
          fp8_grouped_linear_ref, _fake, triton="quant_linear_triton.fp8_grouped_linear_triton")
define_op("fp4_grouped_linear", f"({WEIGHTS}, Tensor offs, bool round_scale, str dialect) "
          "-> Tensor", fp4_grouped_linear_ref, _fake,
          triton="quant_linear_triton.fp4_grouped_linear_triton")


def _check_x(x) -> int:
    check_tensor("x", x, dtype=torch.bfloat16, dim=2)
    k = x.shape[1]
    if k == 0 or k % ACT_BLOCK:
        raise ValueError(f"x must have its last dimension K a positive multiple of {ACT_BLOCK} "
                         f"(act_quant's block), got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()}")
    return k


def _check_weight(weight, weight_scale, shape, scale_shape, dtypes, scale_dtypes, dev) -> None:
    check_tensor("weight", weight, dtypes=dtypes, shape=shape, device=dev)
    check_tensor("weight_scale", weight_scale, dtypes=scale_dtypes, shape=scale_shape, device=dev)
    for name, t in (("weight", weight), ("weight_scale", weight_scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _check_offs(offs, n_groups: int, x: torch.Tensor, kernel: KernelOptions) -> None:
    """int32 [E] on x's device; with value checks (one host read): non-decreasing, from 0 to at
    most x's rows."""
    check_tensor("offs", offs, dtype=torch.int32, shape=(n_groups,), device=x.device)
    n_rows = x.shape[0]
    if n_groups and value_checks_enabled(kernel):
        ends = offs.tolist()
        if ends[0] < 0 or ends[-1] > n_rows or any(b < a for a, b in zip(ends, ends[1:])):
            raise ValueError(f"offs must be non-decreasing cumulative end rows between 0 and "
                             f"x's {n_rows} rows, got {ends}")


def _check_scale_fmt(scale_fmt) -> bool:
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    return scale_fmt is not None


def _fp8_backend(op, x, weight, kernel) -> str:
    fnuz_platform_ocp_weight = kernel.fp8_dialect is FNUZ and weight.dtype == torch.float8_e4m3fn
    return resolve(op, x.device, kernel.backend, triton_ok=not fnuz_platform_ocp_weight)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
               scale_fmt: str | None = "ue8m0", out_dtype: torch.dtype = torch.bfloat16,
               kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """bf16 [M, N] = act_quant(x) @ weight.T, the reference's FP8 linear. x bf16 [M, K]
    (K % 128 == 0, contiguous); weight [N, K] float8_e4m3fn (or float8_e4m3fnuz from
    `ocp_to_fnuz`); weight_scale [ceil(N/128), K/128] (float32, bfloat16, float8_e8m0fnu or its
    bytes as uint8). out_dtype float32: the fp32 accumulator not rounded to bf16 (a
    tensor-parallel rank's partial product, rounded after the sum over ranks).
    kernel.backend picks the backend (no HIP version: hip runs Triton)."""
    check_kernel(kernel)
    round_scale = _check_scale_fmt(scale_fmt)
    if out_dtype not in FP8_LINEAR_OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    k = _check_x(x)
    n = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    _check_weight(weight, weight_scale, (None, k), (-(-(n or 0) // ACT_BLOCK), k // ACT_BLOCK),
                  FP8_WEIGHT_DTYPES, FP8_SCALE_DTYPES, x.device)
    backend = _fp8_backend("fp8_linear", x, weight, kernel)
    return op("fp8_linear", backend)(x, weight, weight_scale, round_scale, out_dtype)


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       offs: torch.Tensor, *, scale_fmt: str | None = "ue8m0",
                       kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """bf16 [P, N]: row r of expert e's group (offs[e-1] <= r < offs[e]) times weight[e], as
    `fp8_linear` computes it. weight [E, N, K] fp8, weight_scale [E, ceil(N/128), K/128],
    offs int32 [E] on x's device; rows past offs[-1] are 0. offs is checked on the host (one
    read) unless value checks are off (kernel.value_checks, graph capture)."""
    check_kernel(kernel)
    round_scale = _check_scale_fmt(scale_fmt)
    k = _check_x(x)
    e, n = weight.shape[:2] if isinstance(weight, torch.Tensor) and weight.dim() == 3 else (0, 0)
    _check_weight(weight, weight_scale, (None, None, k),
                  (e, -(-n // ACT_BLOCK), k // ACT_BLOCK), FP8_WEIGHT_DTYPES, FP8_SCALE_DTYPES,
                  x.device)
    _check_offs(offs, e, x, kernel)
    backend = _fp8_backend("fp8_grouped_linear", x, weight, kernel)
    return op("fp8_grouped_linear", backend)(x, weight, weight_scale, offs, round_scale)


def fp4_grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       offs: torch.Tensor, *, scale_fmt: str | None = "ue8m0",
                       kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """bf16 [P, N]: the routed experts' FP4 linear. Row r of expert e's group (offs[e-1] <= r <
    offs[e]) is quantized as act_quant does and multiplied with weight[e]: e2m1 codes packed two
    per byte along K, element 2i in the low nibble, [E, N, K/2] (int8 as published, uint8 or
    float4_e2m1fn_x2), weight_scale ue8m0 [E, N, K/32] (float8_e8m0fnu or its bytes as uint8).
    offs int32 [E] cumulative end rows on x's device (checked as in `fp8_grouped_linear`); rows
    past offs[-1] are 0."""
    check_kernel(kernel)
    round_scale = _check_scale_fmt(scale_fmt)
    k = _check_x(x)
    e, n = weight.shape[:2] if isinstance(weight, torch.Tensor) and weight.dim() == 3 else (0, 0)
    _check_weight(weight, weight_scale, (None, None, k // 2), (e, n, k // FP4_BLOCK),
                  FP4_WEIGHT_DTYPES, FP4_SCALE_DTYPES, x.device)
    _check_offs(offs, e, x, kernel)
    backend = resolve("fp4_grouped_linear", x.device, kernel.backend)
    return op("fp4_grouped_linear", backend)(x, weight, weight_scale, offs, round_scale,
                                             kernel.fp8_dialect.name)
