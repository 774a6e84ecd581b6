"""Torch references of DeepSeek-V4's quantized linears (the reference's `act_quant`, `fp8_gemm` and
`fp4_gemm` of its inference/kernel.py), and the load-time conversion of OCP FP8 weights to the
fnuz dialect of MI300.

What the reference computes, and these functions follow step for step:

- act_quant: per 128-wide block of a bf16 row, amax = max |x| in fp32, floored at 1e-4;
  s = amax * fp32(1/448) (a multiply by the fp32 reciprocal, not a division); with the ue8m0
  scale format s is rounded up to a power of two from its fp32 bits (exponent + 1 when the
  mantissa is not zero); q = e4m3fn(clamp(x / s, -448, 448)) (true division, round to nearest
  even); s is returned as fp32.
- fp8_gemm: per 128-wide K block, the fp32 sum of the 128 products of fp8 values, then
  acc += partial * (sa[m, kb] * sb[n // 128, kb]) in fp32; one rounding to bf16 at the end.
- fp4_gemm: the same with e2m1 weights and a weight scale per 32-wide K block, so the partial
  sums run over 32 products: acc += partial * sa[m, k // 128] * sb[n, k // 32], multiplied left
  to right in fp32.

Exactness. The products of fp8 and e2m1 values are exact, and so is their sum in float64 (it
needs at most 43 bits), so each block's partial here is the exactly rounded fp32 value of its
sum; every later step is the reference's fp32 operation in the reference's order (a multiply,
then an add: no fused multiply-add). A GPU sums the 128 (or 32) products in its own fp32 order
(NVIDIA's FP8 tensor cores even with fewer accumulator bits), so a GPU's partial may differ from
this one in its last bits; with the published ue8m0 scales (powers of two) nothing else differs,
and a fused multiply-add equals the multiply then add.

fnuz (MI300): the bits of an e4m3fn value read as e4m3fnuz are half its value, for normals and
subnormals alike, so an fnuz weight with its scale doubled (`ocp_to_fnuz`) and activations stored
as fnuz(clamp(x / s, -448, 448) / 2) with scale 2s dequantize to exactly the reference's values,
and the GEMM's partials are exactly a quarter of the OCP ones: the same bf16 results bit for bit.
"""

from __future__ import annotations

import torch

from .capture import is_capturing
from .platform import DIALECTS, FNUZ, OCP, Fp8Dialect

ACT_BLOCK = 128
FP4_BLOCK = 32
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_FORMATS = (None, "ue8m0")
# e2m1 code -> value (codes 8..15: the negatives of 0..7); exact in fp8 e4m3 and bf16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
OCP_NAN_BYTES = (0x7F, 0xFF)
E8M0_NAN_BYTE = 0xFF


def round_scale_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """fp32 s > 0 (normal) -> the smallest power of two >= s, from the bits as the reference
    does (exponent field + 1 when the mantissa is not zero)."""
    bits = s.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def act_scales(x: torch.Tensor, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """fp32 scales [..., K/128] of bf16 x [..., K] (see the module doc)."""
    amax = x.float().unflatten(-1, (-1, ACT_BLOCK)).abs().amax(-1).clamp_min(AMAX_FLOOR)
    s = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=x.device)
    return round_scale_up_pow2(s) if scale_fmt is not None else s


def act_quant(x: torch.Tensor, scale_fmt: str | None = "ue8m0",
              dialect: Fp8Dialect = OCP) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's act_quant(x, 128, scale_fmt): bf16 x [..., K] (K % 128 == 0) ->
    (q [..., K] in the dialect's fp8 dtype, fp32 scales [..., K/128]). OCP: the reference's
    bytes and scales exactly. fnuz: q holds half the reference's value in the same bits (0x80,
    OCP -0, stored 0x00) and the scale is doubled, so q * s is the reference's value exactly."""
    s = act_scales(x, scale_fmt)
    y = (x.float().unflatten(-1, (-1, ACT_BLOCK)) / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    if dialect is FNUZ:
        y, s = y * 0.5, s * 2
    return y.flatten(-2).to(dialect.torch_dtype), s


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (float8_e8m0fnu, or its bytes as uint8) or plain float scales -> fp32."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.to(torch.float32)


def e2m1_to_float(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 pairs [..., K/2] (int8, uint8 or float4_e2m1fn_x2; element 2i in the low
    nibble) -> fp32 [..., K]."""
    codes = packed.view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    pairs = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1)
    return pairs.flatten(-2)


def _blocked_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                  k_block: int, act_per_block: int, fp4: bool) -> torch.Tensor:
    """a float64 [M, K] (exact fp8 values), sa fp32 [M, K/128], b float64 [N, K], sb fp32
    [N, K/k_block] (one column per K block, already expanded over rows) -> fp32 [M, N]."""
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    for kb in range(a.shape[1] // k_block):
        cols = slice(kb * k_block, (kb + 1) * k_block)
        partial = (a[:, cols] @ b[:, cols].T).float()       # exact sum, rounded once to fp32
        s_a = sa[:, kb // act_per_block, None]
        s_b = sb[None, :, kb]
        acc = acc + (partial * s_a * s_b if fp4 else partial * (s_a * s_b))
    return acc


def fp8_gemm_ref(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The reference's fp8_gemm: qa fp8 [M, K] with fp32 sa [M, K/128]; qb fp8 [N, K] (either
    dialect, the same as qa's) with sb [ceil(N/128), K/128] (fp32, bf16, ue8m0) -> bf16 [M, N]
    (out_dtype float32: the fp32 accumulator itself, not rounded)."""
    sb_rows = e8m0_to_float(sb).repeat_interleave(ACT_BLOCK, dim=0)[:qb.shape[0]]
    acc = _blocked_gemm(qa.double(), sa, qb.double(), sb_rows, ACT_BLOCK, 1, fp4=False)
    return acc.to(out_dtype)


def fp4_gemm_ref(qa: torch.Tensor, sa: torch.Tensor, packed: torch.Tensor,
                 sb: torch.Tensor) -> torch.Tensor:
    """The reference's fp4_gemm: qa fp8 [M, K] with fp32 sa [M, K/128]; packed e2m1 [N, K/2]
    with ue8m0 sb [N, K/32] -> bf16 [M, N]."""
    acc = _blocked_gemm(qa.double(), sa, e2m1_to_float(packed).double(), e8m0_to_float(sb),
                        FP4_BLOCK, ACT_BLOCK // FP4_BLOCK, fp4=True)
    return acc.to(torch.bfloat16)


def groups(offs: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) row range of each expert from cumulative end rows offs [E] (one host read)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       offs: torch.Tensor, scale_fmt: str | None, dialect: Fp8Dialect,
                       fp4: bool) -> torch.Tensor:
    """Rows [start, end) of expert e: act_quant, then expert e's GEMM; rows past offs[-1]: 0.
    Inside a graph capture, where offs cannot be read on the host, every expert's GEMM runs over
    all rows and each row keeps its own expert's result: the same bits (rows are independent),
    E times the work."""
    out = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.bfloat16, device=x.device)
    gemm = fp4_gemm_ref if fp4 else fp8_gemm_ref
    if is_capturing():
        q, s = act_quant(x, scale_fmt, dialect)
        rows = torch.arange(x.shape[0], dtype=offs.dtype, device=x.device)
        row_expert = torch.searchsorted(offs, rows, right=True)[:, None]
        for e in range(weight.shape[0]):
            out = torch.where(row_expert == e, gemm(q, s, weight[e], weight_scale[e]), out)
        return out
    for e, (start, end) in enumerate(groups(offs)):
        if end > start:
            q, s = act_quant(x[start:end], scale_fmt, dialect)
            out[start:end] = gemm(q, s, weight[e], weight_scale[e])
    return out


def weight_dialect(weight: torch.Tensor) -> Fp8Dialect:
    """The dialect of an FP8 weight: its dtype's (fnuz after `ocp_to_fnuz`, else OCP)."""
    return FNUZ if weight.dtype == torch.float8_e4m3fnuz else OCP


def _scale_fmt(round_scale: bool) -> str | None:
    return "ue8m0" if round_scale else None


def fp8_linear_ref(x, weight, weight_scale, round_scale: bool,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The fp8_linear op's torch backend: act_quant in the weight's dialect, then fp8_gemm."""
    q, s = act_quant(x, _scale_fmt(round_scale), weight_dialect(weight))
    return fp8_gemm_ref(q, s, weight, weight_scale, out_dtype)


def fp8_grouped_linear_ref(x, weight, weight_scale, offs, round_scale: bool) -> torch.Tensor:
    """The fp8_grouped_linear op's torch backend (the activations in the weight's dialect)."""
    return grouped_linear_ref(x, weight, weight_scale, offs, _scale_fmt(round_scale),
                              weight_dialect(weight), False)


def fp4_grouped_linear_ref(x, weight, weight_scale, offs, round_scale: bool,
                           dialect: str) -> torch.Tensor:
    """The fp4_grouped_linear op's torch backend (the activations in the fp8 dialect named)."""
    return grouped_linear_ref(x, weight, weight_scale, offs, _scale_fmt(round_scale),
                              DIALECTS[dialect], True)


def ocp_to_fnuz(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3fn weight (float8_e4m3fn, or its bytes as uint8) and its scale -> the same bytes as
    float8_e4m3fnuz and the scale doubled (same dtype: fp32/bf16 times 2, ue8m0 exponent + 1),
    so every dequantized value is unchanged. 0x80 (OCP -0, the fnuz NaN) becomes 0x00. Raises
    on an OCP NaN byte (0x7F, 0xFF: fnuz reads them as 240 and -240, so a NaN in a checkpoint
    would silently become a number) and on a ue8m0 scale of 2^127 or NaN (no double exists).
    Reads the tensors on the host once (a load-time conversion)."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"weight must have dtype torch.float8_e4m3fn (or its bytes as "
                        f"torch.uint8), got {weight.dtype}")
    if scale.dtype not in (torch.float32, torch.bfloat16, torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scale must have dtype torch.float32, torch.bfloat16 or "
                        f"torch.float8_e8m0fnu (or its bytes as torch.uint8), got {scale.dtype}")
    b = weight.view(torch.uint8)
    nan = (b & 0x7F) == 0x7F
    if bool(nan.any()):
        index = tuple(int(i) for i in nan.nonzero()[0])
        raise ValueError(f"weight holds an e4m3fn NaN byte (0x7F/0xFF) at {index}: fnuz has no "
                         "such NaN; refusing to convert it to a finite value")
    fnuz = torch.where(b == 0x80, torch.zeros_like(b), b).view(torch.float8_e4m3fnuz)
    if scale.dtype in (torch.float32, torch.bfloat16):
        return fnuz, scale * 2
    sb = scale.view(torch.uint8)
    if bool((sb >= E8M0_NAN_BYTE - 1).any()):
        raise ValueError("scale holds a ue8m0 value of 2^127 or NaN: it cannot be doubled")
    return fnuz, (sb + 1).view(scale.dtype)
