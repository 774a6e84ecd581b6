"""Seeded inputs of the set-KV ops for tests: rows of mixed magnitude, strided views, locations
with skipped (-1) rows, sentinel-filled caches."""

from __future__ import annotations

import torch

from hip_kernels import kv_layout as L

SENTINEL = 0xA5
MAX_POS = 97


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bf16_rows(g, n: int, width: int, pad: int = 0) -> torch.Tensor:
    """[n, width] bf16 rows, each scaled by 10^U(-2, 2), with a zero tile in row 0 (the amax
    floor) and, for n > 2, an all-zero row 1; with pad > 0 the rows are a strided slice of a
    wider tensor."""
    x = torch.randn(n, width + pad, generator=g) * 10 ** (4 * torch.rand(n, 1, generator=g) - 2)
    rows = x.to(torch.bfloat16)[:, pad // 2:pad // 2 + width]
    rows[0, 64:128] = 0
    if n > 2:
        rows[1] = 0
    return rows


def locations(g, n: int, capacity: int, dtype=torch.int64, skip_every: int = 4) -> torch.Tensor:
    """n distinct locations in [0, capacity), every skip_every-th one -1."""
    loc = torch.randperm(capacity, generator=g)[:n].to(dtype)
    loc[1::skip_every] = -1
    return loc


def strided(t: torch.Tensor, stride: int) -> torch.Tensor:
    """The same values as a 1-D view with element stride `stride` (a slice of a wider buffer)."""
    if stride == 1:
        return t
    buf = torch.zeros(t.shape[0] * stride, dtype=t.dtype)
    buf[::stride] = t
    return buf[::stride]


def freqs_cis(g, max_pos: int = MAX_POS) -> torch.Tensor:
    angles = torch.rand(max_pos, L.ROPE_DIM // 2, generator=g) * 6.3
    return torch.polar(torch.ones_like(angles), angles)


def kv_cache(pages: int, page_size: int) -> torch.Tensor:
    return torch.full((pages, L.page_bytes(page_size)), SENTINEL, dtype=torch.uint8)


def indexer_cache(pages: int, page_size: int) -> torch.Tensor:
    return torch.full((pages, L.indexer_page_bytes(page_size)), SENTINEL, dtype=torch.uint8)


def norm_rope_args(seed: int, n: int, page_size: int, pages: int, heads: int = 0,
                   loc_dtype=torch.int64, weight_dtype=torch.bfloat16,
                   index_stride: int = 1) -> dict:
    """Keyword arguments of fused_k_norm_rope_store (q included when heads > 0; positions and
    out_loc with element stride index_stride)."""
    g = gen(seed)
    args = dict(
        kv=bf16_rows(g, n, L.HEAD_DIM, pad=96),
        # magnitudes 0.5..1.5 with random signs (zeros times negative weights give -0.0)
        weight=((torch.rand(L.HEAD_DIM, generator=g) + 0.5)
                * torch.randint(0, 2, (L.HEAD_DIM,), generator=g).mul(2).sub(1)).to(weight_dtype),
        eps=1e-6,
        freqs_cis=freqs_cis(g),
        positions=strided(torch.randint(0, MAX_POS, (n,), generator=g,
                                        dtype=torch.int32 if n % 2 else torch.int64), index_stride),
        out_loc=strided(locations(g, n, pages * page_size, loc_dtype), index_stride),
        cache=kv_cache(pages, page_size),
        page_size=page_size,
    )
    if heads:
        q = torch.randn(n, heads, L.HEAD_DIM + 64, generator=g).to(torch.bfloat16)
        args["q"] = q[:, :, 32:32 + L.HEAD_DIM]
    return args


def clone_args(args: dict) -> dict:
    """Deep copy of the tensors (views of wider tensors stay views of a fresh copy)."""
    out = {}
    for k, v in args.items():
        if isinstance(v, torch.Tensor) and not v.is_contiguous():
            base = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
            base.copy_(v)
            out[k] = base
        else:
            out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def to_device(args: dict, device) -> dict:
    """args with every tensor moved to device (the GPU run of the tests; a no-op on a CPU)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe) of two tensors of the same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
