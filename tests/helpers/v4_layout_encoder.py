"""An independent encoder of the V4 paged FP8 KV layout, for tests (it shares no code with
`hip_kernels.kv_layout`): byte positions from the layout's definition, the per-tile scale from
math.frexp, the arithmetic in numpy float32 (IEEE, one rounding per operation); torch only for
the bf16 and fp8 round-to-nearest-even casts.

Layout of a page of P tokens: token t's 448 fp8 values then 64 bf16 (little-endian) at t*576;
its 7 ue8m0 scale bytes (exponent + 127) and a zero pad byte at P*576 + t*8; pages are
ceil(P*584/576)*576 bytes apart.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def page_stride(page_size: int) -> int:
    return math.ceil(page_size * 584 / 576) * 576


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (as float32)."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


def ceil_log2(x: float) -> int:
    m, e = math.frexp(x)           # x = m * 2^e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


def encode_row(row: np.ndarray, fp8_dtype: torch.dtype, fp8_max: float, amax_floor: float):
    """(576 value bytes, 8 scale bytes) of one row of 512 float32 values (stored as given:
    no rounding before quantization)."""
    row = np.asarray(row, np.float32)
    values, scales = bytearray(), bytearray(8)
    for tile in range(7):
        x = row[tile * 64:(tile + 1) * 64]
        amax = max(float(np.abs(x).max()), amax_floor)
        e = ceil_log2(float(np.float32(amax) / np.float32(fp8_max)))
        q = np.clip(x * np.float32(2.0 ** -e), -fp8_max, fp8_max).astype(np.float32)
        values += torch.from_numpy(q).to(fp8_dtype).view(torch.uint8).numpy().tobytes()
        scales[tile] = e + 127
    rope = torch.from_numpy(row[448:].copy()).to(torch.bfloat16)
    values += rope.view(torch.int16).numpy().astype("<i2").tobytes()
    return bytes(values), bytes(scales)


def encode_into(pages: np.ndarray, page_size: int, loc: list[int], rows: np.ndarray,
                fp8_dtype: torch.dtype, fp8_max: float, amax_floor: float) -> None:
    """Write rows at loc (negative = skipped) into `pages` (contiguous uint8
    [n_pages, page_stride])."""
    if not pages.flags.c_contiguous:
        raise ValueError("pages must be a contiguous array")
    flat = pages.reshape(-1)
    stride = page_stride(page_size)
    for slot, row in zip(loc, rows):
        if slot < 0:
            continue
        page, t = divmod(slot, page_size)
        values, scales = encode_row(row, fp8_dtype, fp8_max, amax_floor)
        base = page * stride
        flat[base + t * 576: base + t * 576 + 576] = np.frombuffer(values, np.uint8)
        flat[base + page_size * 576 + t * 8: base + page_size * 576 + t * 8 + 8] = \
            np.frombuffer(scales, np.uint8)


def norm_rope_fp32(kv: np.ndarray, weight: np.ndarray, eps: float, cos: np.ndarray,
                   sin: np.ndarray) -> np.ndarray:
    """RMSNorm with weight kept in float32 (no bf16 rounding), then interleaved RoPE on dims
    448..511 in float32 (a*c - b*s, a*s + b*c) rounded to bf16. kv, weight: bf16 values as
    float32; cos/sin [N, 32]."""
    kv = np.asarray(kv, np.float32)
    ss = (kv.astype(np.float64) ** 2).sum(-1, keepdims=True)         # exact for bf16 inputs
    ms = (ss / kv.shape[-1]).astype(np.float32)
    r = np.float32(1.0) / np.sqrt(ms + np.float32(eps))
    y = (kv * r) * np.asarray(weight, np.float32)
    a, b = y[:, 448::2], y[:, 449::2]
    out = y.copy()
    out[:, 448::2] = bf16(a * cos - b * sin)
    out[:, 449::2] = bf16(a * sin + b * cos)
    return out
