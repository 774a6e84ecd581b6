"""Test-side oracles of the set-KV family's reference numerics (StoreNumerics rms "device",
q_mode "bf16_norm_rope"), shared by the HIP host-harness and the Triton tests: the formula
computed op by op on the CPU, in a stated fp32 summation order, with correctly rounded
reciprocal square roots (numpy, not torch.sqrt, whose vectorized CPU path is not always
correctly rounded)."""

import numpy as np
import torch

from hip_kernels import kv_layout as L
from hip_kernels import numerics as N
from hip_kernels import set_kv_ref as R
from kv_inputs import same_bytes

RN = N.REFERENCE_NUMERICS

# The HIP kernel sums the squares in fp32 in its own order: each lane in element order over its
# 512 / lanes elements, then the xor butterfly over the lanes (kv_row.cuh). Its 1 / sqrt is
# IEEE 1 / sqrt_rn in fp32. torch.sqrt is not used for the formula: on CPU builds whose
# vectorized sqrt is not correctly rounded (seen with torch 2.13 on AVX512: about 17% of fp32
# values 1 ulp off) it would not be the formula.


def kernel_order_sum(values: torch.Tensor, lanes: int) -> torch.Tensor:
    """fp32 sums over the last dim [..., 512] -> [..., 1] in the kernel's order."""
    parts = values.float().unflatten(-1, (lanes, -1))
    lane_sums = torch.zeros(parts.shape[:-1])
    for i in range(parts.shape[-1]):
        lane_sums = lane_sums + parts[..., i]
    partner = torch.arange(lanes)
    m = lanes // 2
    while m:
        lane_sums = lane_sums + lane_sums[..., partner ^ m]
        m //= 2
    return lane_sums[..., :1]


def inv_sqrt_ieee(m: torch.Tensor) -> torch.Tensor:
    """fp32 1 / sqrt_rn(m), each op correctly rounded (the kernel's rms "device" factor)."""
    m32 = m.float().numpy()
    return torch.from_numpy(np.float32(1) / np.sqrt(m32))


def rsqrt_correctly_rounded(m: torch.Tensor) -> torch.Tensor:
    """fp32 1 / sqrt(m) correctly rounded (fp64 sqrt and division, then one rounding)."""
    return torch.from_numpy((1.0 / np.sqrt(m.double().numpy())).astype(np.float32))


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def kv_device_oracle(args: dict, dialect, lanes: int) -> torch.Tensor:
    """The cache after a REFERENCE_NUMERICS store of args' kv rows, in the kernel's sum order:
    r = 1 / sqrt(fp32 sum / 512 + eps), y = bf16(weight * (x * r)), then the reference's RoPE,
    quantization and layout."""
    x = args["kv"].float()
    eps = torch.tensor(args["eps"], dtype=torch.float32)
    r = inv_sqrt_ieee(kernel_order_sum(x * x, lanes) / L.HEAD_DIM + eps)
    y = (args["weight"].float() * (x * r)).to(torch.bfloat16)
    f = args["freqs_cis"][args["positions"].long()]
    rows = torch.cat([y[:, :L.NOPE_DIM], R.rope_bf16(y[:, L.NOPE_DIM:], f.real, f.imag)], 1)
    nope, rope, scales = L.quantize_kv_rows(rows, dialect, RN)
    values, scale_bytes = L.pack_kv_bytes(nope, rope, scales)
    cache = args["cache"].clone()
    L.write_kv_bytes(cache, args["out_loc"], args["page_size"], values, scale_bytes)
    return cache


def q_bf16_oracle(q, eps, freqs_cis, positions, lanes: int):
    """q_mode "bf16_norm_rope" op by op: sq = bf16(x*x); ms = bf16(fp32 sum of sq / 512) (the
    kernel's order); m2 = bf16(ms + eps); r = bf16(correctly rounded fp32 1 / sqrt(m2)); nope
    bf16(x*r); RoPE of bf16(x*r) as the reference. Returns (q out, m2, r)."""
    x = q.float()
    ms = bf16_round(kernel_order_sum(bf16_round(x * x), lanes) / L.HEAD_DIM)
    m2 = bf16_round(ms + torch.tensor(eps, dtype=torch.float32))
    r = bf16_round(rsqrt_correctly_rounded(m2))
    y = (x * r).to(torch.bfloat16)
    f = freqs_cis[positions.long()]
    rope = R.rope_bf16(y[..., L.NOPE_DIM:], f.real.unsqueeze(1), f.imag.unsqueeze(1))
    return torch.cat([y[..., :L.NOPE_DIM], rope], -1), m2, r


def check_q(got_q, args, lanes, want_ref_q) -> dict:
    """got_q must be the oracle's bytes. Where it differs from the torch reference (on the CPU)
    one of two known CPU deviations must be the cause: torch's bf16 rsqrt, which is about
    bf16(1 / bf16(sqrt(m2))) there (0.8671875 -> 1.078125, correctly rounded 1.0703125); or
    torch's CPU `bf16 tensor + eps`, which rounds eps to bf16 first (the oracle, this kernel and
    the Triton kernel add the fp32 eps), visible where the mean square is a few eps at most.
    The sum order never is: the bf16 mean squares must be torch's. Returns counts of heads."""
    q, eps = args["q"], args["eps"]
    want, m2, r = q_bf16_oracle(q, eps, args["freqs_cis"], args["positions"], lanes)
    assert same_bytes(got_q, want), "q differs from the bf16_norm_rope oracle"
    torch_ms = q.square().mean(-1, keepdim=True)
    oracle_ms = bf16_round(kernel_order_sum(bf16_round(q.float() ** 2), lanes) / L.HEAD_DIM)
    assert torch.equal(torch_ms.float(), oracle_ms), "the sum order changed a bf16 mean square"
    torch_m2 = torch_ms + eps
    eps_differs = torch_m2.float() != m2
    rsqrt_differs = ~eps_differs & (torch.rsqrt(torch_m2).float() != r)
    differs = (got_q.view(torch.int16) != want_ref_q.view(torch.int16)).any(-1, keepdim=True)
    assert not (differs & ~eps_differs & ~rsqrt_differs).any(), "an unexplained q difference"
    return {"heads": differs.numel(), "differ": int(differs.sum()),
            "rsqrt": int((differs & rsqrt_differs).sum()),
            "eps": int((differs & eps_differs).sum())}
