"""CPU stand-ins for the DeepSeek-V4 reference inference kernels (the TileLang ``kernel.py`` that
ships with the weights, and the ``fast_hadamard_transform`` CUDA extension that ``model.py``'s
``rotate_activation`` imports), for the numerics oracle in this folder.

Each function takes the arguments of the kernel it replaces and follows that kernel's numerics as
far as torch on a CPU can: the dtype of every intermediate, where values are rounded to bf16, and
the block structure of the reductions. What a CPU cannot reproduce is the order of the fp32
additions inside a tensor-core GEMM or a warp reduction; those use torch's fp32 sums, except the
block-scaled GEMMs of the reference's FP8 mode (``fp8_gemm``, ``fp4_gemm``), whose per-block sums
of fp8 x fp8 (or fp8 x fp4) products are computed exactly and rounded once to fp32, so their bits
depend on neither the CPU's GEMM kernel nor the row count.

The reference's FP8 mode (``dtype="fp8"``, ``expert_dtype="fp4"``, ue8m0 scales) runs every
quantized linear as ``act_quant`` (per 128 of K: a power-of-two scale, e4m3 values) followed by
``fp8_gemm`` (FP8 weights, 128x128 scales) or ``fp4_gemm`` (FP4 routed experts, 1x32 scales).

The reference's model.py is never modified: ``install()`` registers this module as ``kernel`` and
a small module as ``fast_hadamard_transform`` in ``sys.modules`` before model.py is imported.

Numerics switches (module globals, set by ``configure``):

- ``HADAMARD``: "cuda" (default) follows the fast_hadamard_transform CUDA kernel: the butterfly in
  fp32, times the scale in fp32, one rounding to the input dtype. "ref" follows that package's
  ``hadamard_transform_ref`` (``F.linear`` with the +-1 matrix in the input dtype, then ``* scale``
  in the input dtype: two bf16 roundings).
- ``SPARSE_ATTN``: "tilelang" (default) follows ``sparse_attn_kernel``: 64-row blocks in
  ``topk_idxs`` order, an online softmax whose running max excludes the sink, the probabilities
  rounded to bf16 before the P.V GEMM (the denominator keeps them in fp32), fp32 accumulators, the
  sink added to the denominator after the last block, one rounding of the output to bf16.
  "onepass" is the same softmax in one pass over all rows with fp32 probabilities (no bf16
  rounding of P, no per-block rescaling).
"""

from __future__ import annotations

import sys
import types

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
SPARSE_BLOCK = 64

HADAMARD = "cuda"
SPARSE_ATTN = "tilelang"

# The kernels multiply by these reciprocals, which TileLang emits as fp32 constants.
_FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
_FP4_MAX_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)


def configure(hadamard: str | None = None, sparse_attn_mode: str | None = None) -> None:
    global HADAMARD, SPARSE_ATTN
    if hadamard is not None:
        if hadamard not in ("cuda", "ref"):
            raise ValueError(f"hadamard must be 'cuda' or 'ref', got {hadamard!r}")
        HADAMARD = hadamard
    if sparse_attn_mode is not None:
        if sparse_attn_mode not in ("tilelang", "onepass"):
            raise ValueError(f"sparse_attn_mode must be 'tilelang' or 'onepass', "
                             f"got {sparse_attn_mode!r}")
        SPARSE_ATTN = sparse_attn_mode


# ---- scales -------------------------------------------------------------------------------------

def _pow2_ceil(r: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(r)) for fp32 r > 0 from the IEEE bits, like fast_log2_ceil + fast_pow2: the
    biased exponent, plus one when any mantissa bit is set."""
    bits = r.to(torch.float32).contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((e + 127) << 23).view(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.size(-1)
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the block {block}")
    return x.unflatten(-1, (n // block, block))


# ---- FP8 activation quantization (act_quant_kernel) --------------------------------------------

def _fp8_scales(xb: torch.Tensor, round_scale: bool) -> torch.Tensor:
    amax = xb.float().abs().amax(-1, keepdim=True).clamp_min(1e-4)
    r = amax * _FP8_MAX_INV
    return _pow2_ceil(r) if round_scale else r


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None,
              scale_dtype: torch.dtype = torch.float32, inplace: bool = False):
    """Per block of ``block_size`` along the last dim: s = amax * (1/448) (a power of two,
    rounded up, when scale_fmt is set), y = fp8_e4m3(clamp(x / s, +-448)). inplace: x <- x's dtype
    of (fp32(y) * s), the fused quantize-dequantize, and x is returned; else (y, s)."""
    xb = _blocks(x, block_size)
    s = _fp8_scales(xb, scale_fmt is not None)
    y = (xb.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((y.float() * s).to(x.dtype).flatten(-2))
        return x
    return y.flatten(-2), s.squeeze(-1).to(scale_dtype)


# ---- FP4 activation quantization (fp4_quant_kernel) --------------------------------------------

_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 v in [-6, 6] -> the nearest e2m1 value, ties to the even code (the one whose last
    mantissa bit is 0), sign kept. Codes 0..7 are the grid above; an even code is an even index."""
    a = v.abs()
    grid = _E2M1_GRID.to(v.device)
    # index of the grid point just below (or at) a, and the distances to it and the next one
    lo = (torch.searchsorted(grid, a.contiguous(), right=True) - 1).clamp(0, 6)
    below, above = grid[lo], grid[lo + 1]
    d_lo, d_hi = a - below, above - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    r = torch.where(pick_hi, above, below)
    r = torch.where(a >= FP4_MAX, torch.full_like(r, FP4_MAX), r)
    return torch.copysign(r, v)


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace: bool = False):
    """Per block of 32: amax floored at 6 * 2^-126, s = 2^ceil(log2(amax * (1/6))),
    y = e2m1(clamp(x / s, +-6)). inplace: x <- x's dtype of (y * s); else packed (y, s)."""
    xb = _blocks(x, block_size)
    amax = xb.float().abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = _pow2_ceil(amax * _FP4_MAX_INV)
    y = _round_e2m1((xb.float() / s).clamp(-FP4_MAX, FP4_MAX))
    if inplace:
        x.copy_((y * s).to(x.dtype).flatten(-2))
        return x
    return _pack_e2m1(y.flatten(-2)), s.squeeze(-1).to(torch.float8_e8m0fnu)


def _pack_e2m1(y: torch.Tensor) -> torch.Tensor:
    """e2m1 values -> float4_e2m1fn_x2, element 2i in the low nibble, 2i+1 in the high one."""
    grid = _E2M1_GRID.to(y.device)
    code = (y.abs().unsqueeze(-1) == grid).to(torch.uint8).argmax(-1).to(torch.uint8)
    code = code | ((y < 0) | ((y == 0) & torch.signbit(y))).to(torch.uint8) << 3
    pairs = code.unflatten(-1, (-1, 2))
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.view(torch.float4_e2m1fn_x2)


def _unpack_e2m1(b: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [..., K/2] -> fp32 [..., K] (low nibble first)."""
    u = b.view(torch.uint8)
    table = torch.cat([_E2M1_GRID, -_E2M1_GRID]).to(u.device)
    lo, hi = (u & 0x0F).long(), (u >> 4).long()
    return torch.stack([table[lo], table[hi]], -1).flatten(-2)


# ---- block-scaled GEMMs (fp8_gemm_kernel, fp4_gemm_kernel) -------------------------------------

def _block_sums(a: torch.Tensor, b: torch.Tensor, block: int) -> torch.Tensor:
    """a [M, K], b [N, K] (fp32 holding fp8 / fp4 values) -> [K / block, M, N]: per K block, the
    sum of the products computed exactly (float64 holds every partial sum of these products:
    multiples of 2^-18 below 2^25 for e4m3 x e4m3 over 128), rounded once to fp32."""
    a3 = _blocks(a.double(), block).transpose(0, 1)                      # [nb, M, block]
    b3 = _blocks(b.double(), block).transpose(0, 1)                      # [nb, N, block]
    return torch.bmm(a3, b3.transpose(1, 2)).float()


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """C = A @ B^T: A [.., K] e4m3 with one scale per (row, 128 of K), B [N, K] e4m3 with one
    per 128x128 tile. Per 128-wide K block, in K order: the block's fp32 product P, then
    C_acc += P * (sa[row] * sb[column's tile]) in fp32; C rounded once to the default dtype.
    P is the exact sum rounded to fp32 (the tensor core's own order is not reproducible here),
    so C does not depend on the CPU GEMM kernel or on the number of rows."""
    K, N = a.size(-1), b.size(0)
    a2 = a.reshape(-1, K).float()
    sa = a_s.reshape(a2.size(0), -1).float()
    sb = b_s.float().repeat_interleave(128, dim=0)[:N]                 # [N, K / 128]
    parts = _block_sums(a2, b.float(), 128)
    acc = torch.zeros(a2.size(0), N, dtype=torch.float32, device=a.device)
    for kb in range(parts.size(0)):
        acc += parts[kb] * (sa[:, kb:kb + 1] * sb[:, kb])
    return acc.to(torch.get_default_dtype()).view(*a.shape[:-1], N)


def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """C = A @ B^T: A [.., K] e4m3 with one scale per (row, 128 of K), B [N, K / 2] packed e2m1
    (float4_e2m1fn_x2, low nibble first) with one ue8m0 scale per (row, 32 of K). Per 32-wide K
    block, in K order: the block's fp32 product P (exact sum rounded to fp32, as in fp8_gemm),
    then C_acc += P * sa[row, block // 4] * sb[column, block], left to right, in fp32; C rounded
    once to the default dtype."""
    K, N = a.size(-1), b.size(0)
    a2 = a.reshape(-1, K).float()
    sa = a_s.reshape(a2.size(0), -1).float()
    sb = b_s.float()
    parts = _block_sums(a2, _unpack_e2m1(b), 32)
    acc = torch.zeros(a2.size(0), N, dtype=torch.float32, device=a.device)
    for kb in range(parts.size(0)):
        acc += parts[kb] * sa[:, kb // 4:kb // 4 + 1] * sb[:, kb]
    return acc.to(torch.get_default_dtype()).view(*a.shape[:-1], N)


# ---- sparse attention (sparse_attn_kernel) -----------------------------------------------------

def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor,
                topk_idxs: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """q [b, m, h, d] bf16, kv [b, n, d] bf16, attn_sink [h] fp32, topk_idxs [b, m, topk] (-1 =
    none) -> o [b, m, h, d] bf16."""
    if SPARSE_ATTN == "onepass":
        return _sparse_attn_onepass(q, kv, attn_sink, topk_idxs, softmax_scale)
    b, m, h, d = q.shape
    topk = topk_idxs.size(-1)
    scale = torch.tensor(softmax_scale, dtype=torch.float32).item()
    # one query row per (batch, position): n = b * m; the fp32 GEMMs run as [n, h, d] x [n, k, d]
    n = b * m
    qf = q.float().reshape(n, h, d)
    idx_all = topk_idxs.long().reshape(n, topk)
    batch_of = torch.arange(b, device=q.device).repeat_interleave(m).view(n, 1)
    acc_o = torch.zeros(n, h, d, dtype=torch.float32, device=q.device)
    sum_exp = torch.zeros(n, h, dtype=torch.float32, device=q.device)
    row_max = torch.full((n, h), float("-inf"), dtype=torch.float32, device=q.device)
    for start in range(0, topk, SPARSE_BLOCK):
        idx = idx_all[:, start:start + SPARSE_BLOCK]
        if idx.size(-1) < SPARSE_BLOCK:
            idx = torch.nn.functional.pad(idx, (0, SPARSE_BLOCK - idx.size(-1)), value=-1)
        valid = idx != -1                                               # [n, blk]
        rows = kv[batch_of, idx.clamp(min=0)].float()                  # [n, blk, d]
        rows = torch.where(valid.unsqueeze(-1), rows, 0.0)
        # acc_s starts at 0 (valid) or -inf (invalid); the GEMM adds q . k in fp32
        s = torch.where(valid, 0.0, float("-inf")).unsqueeze(1) + torch.einsum(
            "nhd,nkd->nhk", qf, rows)
        s = s * scale
        row_max_new = torch.maximum(row_max, s.amax(-1))
        alpha = torch.exp(row_max - row_max_new)
        p = torch.exp(s - row_max_new.unsqueeze(-1))
        sum_exp = sum_exp * alpha + p.sum(-1)
        acc_o = acc_o * alpha.unsqueeze(-1) + torch.einsum(
            "nhk,nkd->nhd", p.to(torch.bfloat16).float(), rows)
        row_max = row_max_new
    sum_exp = sum_exp + torch.exp(attn_sink.float().view(1, h) - row_max)
    return (acc_o / sum_exp.unsqueeze(-1)).to(torch.bfloat16).view(b, m, h, d)


def _sparse_attn_onepass(q, kv, attn_sink, topk_idxs, softmax_scale):
    b, m, h, d = q.shape
    idx = topk_idxs.long()
    valid = idx != -1
    bidx = torch.arange(b, device=q.device).view(b, 1, 1)
    rows = kv[bidx, idx.clamp(min=0)].float()
    rows = torch.where(valid.unsqueeze(-1), rows, 0.0)
    s = torch.einsum("bmhd,bmkd->bmhk", q.float(), rows) * softmax_scale
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    mx = s.amax(-1)
    p = torch.exp(s - mx.unsqueeze(-1))
    denom = p.sum(-1) + torch.exp(attn_sink.float().view(1, 1, h) - mx)
    o = torch.einsum("bmhk,bmkd->bmhd", p / denom.unsqueeze(-1), rows)
    return o.to(q.dtype)


# ---- mHC split + Sinkhorn (hc_split_sinkhorn_kernel) -------------------------------------------

def _sum4(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Left-to-right fp32 sum along dim (a fixed order for the small hc x hc reductions)."""
    parts = t.unbind(dim)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out.unsqueeze(dim)


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                      hc_mult: int = 4, sinkhorn_iters: int = 20, eps: float = 1e-6):
    """mixes [b, s, (2+hc)*hc] fp32 -> pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc]:
    pre = sigmoid(m * scale0 + base) + eps; post = 2 * sigmoid(m * scale1 + base); comb rows:
    exp(c - rowmax) / rowsum + eps, then c / (colsum + eps), then (iters - 1) times
    c / (rowsum + eps), c / (colsum + eps). All fp32."""
    hc = hc_mult
    m = mixes.float()
    sc = hc_scale.float()
    bs = hc_base.float()
    pre = torch.sigmoid(m[..., :hc] * sc[0] + bs[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * sc[1] + bs[hc:2 * hc])
    c = m[..., 2 * hc:].unflatten(-1, (hc, hc)) * sc[2] + bs[2 * hc:].view(hc, hc)
    c = torch.exp(c - c.amax(-1, keepdim=True))
    c = c / _sum4(c, -1) + eps
    c = c / (_sum4(c, -2) + eps)
    for _ in range(sinkhorn_iters - 1):
        c = c / (_sum4(c, -1) + eps)
        c = c / (_sum4(c, -2) + eps)
    return pre, post, c


# ---- fast_hadamard_transform -------------------------------------------------------------------

def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Walsh-Hadamard transform (Sylvester order) over the last dim, times scale."""
    d = x.size(-1)
    if d & (d - 1):
        raise ValueError(f"hadamard_transform needs a power-of-two last dim here, got {d}")
    if HADAMARD == "ref":
        h = torch.ones(1, 1)
        while h.size(0) < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        out = torch.nn.functional.linear(x, h.to(dtype=x.dtype, device=x.device))
        return out * scale
    y = x.float().reshape(-1, d)
    stride = 1
    while stride < d:
        y = y.view(-1, d // (2 * stride), 2, stride)
        a, c = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + c, a - c], 2).reshape(-1, d)
        stride *= 2
    y = y * torch.tensor(scale, dtype=torch.float32).item()
    return y.view(x.shape).to(x.dtype)


def install() -> None:
    """Make ``import kernel`` and ``import fast_hadamard_transform`` resolve to these shims."""
    sys.modules["kernel"] = sys.modules[__name__]
    fht = types.ModuleType("fast_hadamard_transform")
    fht.hadamard_transform = hadamard_transform
    sys.modules["fast_hadamard_transform"] = fht
