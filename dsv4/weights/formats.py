"""Which weights DeepSeek-V4's published checkpoints store quantized, and what each one costs.

The checkpoints hold the attention projections and the shared expert as FP8 e4m3 with one ue8m0
scale per 128x128 block, the routed experts as FP4 e2m1 (two codes a byte) with one ue8m0 scale
per 1x32 block; everything else (embedding, head, gate, norms, compressors, the indexer's
weights_proj, mHC) as the model keeps it. The reference computes ``wo_a`` in bf16 (its convert.py
dequantizes it), so a model holding the published formats keeps ``wo_a`` bf16 although the
checkpoint stores it in FP8.

Names are the reference's; the routed experts match both per expert (``experts.3.w1.weight``,
as stored) and stacked (``experts.w1``, the model's parameter).
"""

from __future__ import annotations

import math
import re

FP8 = "fp8"
FP4 = "fp4"
FP8_BLOCK = 128          # 128x128 weight blocks; act_quant's blocks along K are 128 wide too
FP4_BLOCK = 32           # 1x32 blocks along K
SCALE_BYTES = 1          # ue8m0

_FP4_WEIGHTS = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+\.)?w[123](\.weight)?$")
_FP8_WEIGHTS = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                          r"|ffn\.shared_experts\.w[123])\.weight$")
_BF16_IN_MODEL = re.compile(r"^layers\.\d+\.attn\.wo_a\.weight$")


def stored_format(name: str) -> str | None:
    """"fp8", "fp4" or None (kept as the model has it) for a tensor of a published checkpoint."""
    if _FP4_WEIGHTS.match(name):
        return FP4
    if _FP8_WEIGHTS.match(name):
        return FP8
    return None


def native_format(name: str) -> str | None:
    """The format a model computing with the published weights holds ``name`` in."""
    return None if _BF16_IN_MODEL.match(name) else stored_format(name)


def quantized_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of a weight of logical ``shape`` ([..., n, k]) in ``fmt``, its scales included."""
    *lead, n, k = shape
    count = math.prod(lead)
    if fmt == FP8:
        blocks = -(-n // FP8_BLOCK) * -(-k // FP8_BLOCK)
        return count * (n * k + blocks * SCALE_BYTES)
    if fmt == FP4:
        return count * (n * k // 2 + n * -(-k // FP4_BLOCK) * SCALE_BYTES)
    raise ValueError(f"fmt must be {FP8!r} or {FP4!r}, got {fmt!r}")


def native_bytes(name: str, shape: tuple[int, ...], element_size: int) -> int:
    """Bytes of the model tensor ``name`` (logical ``shape``, ``element_size`` bytes per value
    when not quantized) in a model holding the published formats."""
    fmt = native_format(name)
    if fmt is None:
        return math.prod(shape) * element_size
    return quantized_bytes(fmt, shape)


def quantized_input_dims(config) -> dict[str, int]:
    """The input dims of the linears that compute in FP8/FP4, by the config fields that set them:
    the reference's act_quant needs each a multiple of 128."""
    return {"dim": config.dim, "q_lora_rank": config.q_lora_rank,
            "o_groups*o_lora_rank": config.o_groups * config.o_lora_rank,
            "moe_inter_dim": config.moe_inter_dim}


def native_problem(config) -> str | None:
    """Why ``config`` cannot compute with the published formats, or None when it can."""
    bad = {k: v for k, v in quantized_input_dims(config).items() if v % FP8_BLOCK}
    if not bad:
        return None
    listed = ", ".join(f"{k}={v}" for k, v in bad.items())
    return (f"the FP8/FP4 linears need input dims that are multiples of {FP8_BLOCK}; this "
            f"config has {listed}")
