"""Torch reference of the set-KV family: the CPU path and the oracle of the Triton/HIP kernels.

Numerics every backend reproduces (so fused and unfused paths write identical bytes):
- RMSNorm: the sum of squares of bf16 inputs is accumulated in fp64 (exact, so independent of
  reduction order), divided by the width, rounded to fp32; r = 1 / sqrt_rn(ms + eps) in fp32;
  y = bf16(weight * (x * r)). With StoreNumerics.rms "device", r = rsqrt(fp32 mean + eps) as
  the device computes them (the reference's), whose last bits depend on the device.
- RoPE on dims 448..511, interleaved pairs: (a, b) -> (a*c - b*d, a*d + b*c) in fp32 from the
  bf16 values, rounded to bf16.
- FP8 quantization of the bf16 nope dims as in `kv_layout.quantize_kv_rows`.

`numerics.StoreNumerics` changes these points explicitly (a host engine's own writer):
without the bf16 rounding the normed row stays fp32 through RoPE and quantization; q_mode says
what a fused q gets (see StoreNumerics). weight None: kv arrives normalized, only RoPE'd.

The stores take the arguments of their dispatcher op (`set_kv.SCHEMAS`), each registered as the
op's torch backend: the fp8 dialect by name, the StoreNumerics by its fields
(`**dataclasses.asdict(numerics)`).
"""

from __future__ import annotations

import torch

from . import kv_layout as L
from .numerics import StoreNumerics
from .platform import DIALECTS


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 rms: str = "exact") -> torch.Tensor:
    """RMSNorm over the last dim of a bf16 tensor, result fp32 (weight None = weightless).
    rms "exact": the squares summed in fp64 (exact), a correctly rounded 1 / sqrt; "device":
    torch's fp32 mean and rsqrt, as the reference."""
    xf = x.float()
    if rms == "device":
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    else:
        ms = (xf.double().square().sum(-1, keepdim=True) / x.shape[-1]).float()
        r = 1.0 / torch.sqrt(ms + torch.tensor(eps, dtype=torch.float32))
    y = xf * r
    if weight is not None:
        y = weight.float() * y
    return y


def rms_norm_bf16_ops(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's weightless q RMSNorm, each op rounded to bf16 in turn:
    x * rsqrt(mean(x^2) + eps) with x^2, the mean, + eps, rsqrt and the product all bf16."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def rope_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of bf16 x [..., 64] with cos/sin [..., 32] (broadcast), result bf16."""
    a = x[..., 0::2].float()
    b = x[..., 1::2].float()
    re = a * cos - b * sin
    im = a * sin + b * cos
    return torch.stack([re, im], dim=-1).flatten(-2).to(torch.bfloat16)


def rope_fma_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of bf16 x [..., 64] rounded as fma(a, c, rn(-b*s)), fma(b, c, rn(a*s)),
    result bf16. The fma is exact in fp64 (an fp32 product has 48 bits) before one rounding."""
    a = x[..., 0::2].float()
    b = x[..., 1::2].float()
    c = cos.double()
    re = (a.double() * c + (-(b * sin)).double()).float()
    im = (b.double() * c + (a * sin).double()).float()
    return torch.stack([re, im], dim=-1).flatten(-2).to(torch.bfloat16)


def _norm_rope_rows(kv, weight, eps, freqs_cis, positions, numerics: StoreNumerics):
    y = kv.float() if weight is None else rms_norm_fp32(kv, weight, eps, numerics.rms)
    if numerics.round_to_bf16:
        y = y.to(torch.bfloat16)
    f = freqs_cis[positions.long()]
    rope = rope_bf16(y[:, L.NOPE_DIM:], f.real, f.imag)
    return torch.cat([y[:, :L.NOPE_DIM], rope.to(y.dtype)], dim=1), f


def _norm_rope_q(q, eps, f, numerics: StoreNumerics) -> None:
    cos, sin = f.real.unsqueeze(1), f.imag.unsqueeze(1)
    if numerics.q_mode == "rope_only":
        q[..., L.NOPE_DIM:] = rope_fma_bf16(q[..., L.NOPE_DIM:], cos, sin)
        return
    if numerics.q_mode == "bf16_norm_rope":
        yq = rms_norm_bf16_ops(q, eps)
    else:
        yq = rms_norm_fp32(q, None, eps, numerics.rms)
    if numerics.q_mode == "norm_rope":
        yq = yq.to(torch.bfloat16)
    rope = rope_bf16(yq[..., L.NOPE_DIM:], cos, sin)
    q[..., :L.NOPE_DIM] = yq[..., :L.NOPE_DIM]
    q[..., L.NOPE_DIM:] = rope


def _store_rows(rows, cache, loc, page_size, dialect: str, numerics: StoreNumerics) -> None:
    nope, rope, scales = L.quantize_kv_rows(rows, DIALECTS[dialect], numerics)
    values, scale_bytes = L.pack_kv_bytes(nope, rope, scales)
    L.write_kv_bytes(cache, loc, page_size, values, scale_bytes)


def _norm_rope_store(kv, weight, eps, freqs_cis, positions, loc, cache, page_size, q,
                     dialect: str, numerics: StoreNumerics) -> None:
    rows, f = _norm_rope_rows(kv, weight, eps, freqs_cis, positions, numerics)
    _store_rows(rows, cache, loc, page_size, dialect, numerics)
    if q is not None:
        _norm_rope_q(q, eps, f, numerics)


def fused_k_norm_rope_store(kv, weight, eps, freqs_cis, positions, out_loc, cache, page_size,
                            q, dialect: str, round_to_bf16: bool, fp8_max: float | None,
                            amax_floor: float, q_mode: str, rms: str) -> None:
    _norm_rope_store(kv, weight, eps, freqs_cis, positions, out_loc, cache, page_size, q,
                     dialect, StoreNumerics(round_to_bf16, fp8_max, amax_floor, q_mode, rms))


def fused_store_cache(rows, cache, out_loc, page_size, dialect: str, round_to_bf16: bool,
                      fp8_max: float | None, amax_floor: float, q_mode: str, rms: str) -> None:
    _store_rows(rows, cache, out_loc, page_size, dialect,
                StoreNumerics(round_to_bf16, fp8_max, amax_floor, q_mode, rms))


def store_kv_pack(nope_fp8, rope_bf16, scales, cache, out_loc, page_size) -> None:
    values, scale_bytes = L.pack_kv_bytes(nope_fp8, rope_bf16, scales)
    L.write_kv_bytes(cache, out_loc, page_size, values, scale_bytes)


def indexer_store(k, cache, out_loc, page_size, dialect: str, pow2_scale: bool,
                  key_tile: int) -> None:
    qk, scale = L.quantize_indexer_rows(k, DIALECTS[dialect], pow2_scale)
    L.write_indexer_bytes(cache, out_loc, page_size, qk, scale, key_tile)


def translate_full_to_swa(full_loc: torch.Tensor, full_to_swa: torch.Tensor) -> torch.Tensor:
    """int32 SWA slots of full locations: full_to_swa[loc], -1 where loc < 0 or loc is past the
    map (0 = unmapped)."""
    loc = full_loc.long()
    valid = (loc >= 0) & (loc < full_to_swa.shape[0])
    swa = full_to_swa[torch.where(valid, loc, torch.zeros_like(loc))].to(torch.int32)
    return torch.where(valid, swa, torch.full_like(swa, -1))


def fused_translate_norm_rope_store(kv, weight, eps, freqs_cis, positions, full_loc, full_to_swa,
                                    cache, page_size, swa_loc_out, q, dialect: str,
                                    round_to_bf16: bool, fp8_max: float | None,
                                    amax_floor: float, q_mode: str, rms: str) -> None:
    """fused_k_norm_rope_store at the SWA slots of full_loc (unmapped slot 0: no write)."""
    swa = translate_full_to_swa(full_loc, full_to_swa)
    write_loc = torch.where(swa > 0, swa, torch.full_like(swa, -1))
    _norm_rope_store(kv, weight, eps, freqs_cis, positions, write_loc, cache, page_size, q,
                     dialect, StoreNumerics(round_to_bf16, fp8_max, amax_floor, q_mode, rms))
    if swa_loc_out is not None:
        swa_loc_out.copy_(swa)
