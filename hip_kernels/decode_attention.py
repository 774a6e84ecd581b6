"""DeepSeek-V4's sparse attention over the paged FP8 KV caches, as one dispatcher op
(`torch.ops.dsv4.sparse_decode_attention`).

Each query row n attends one softmax over two segments of KV rows (K = V, 512 wide): its
sliding window (SWA cache slots ``window_loc[n]``) and the compressed rows the indexer or the
compress plan picked (``comp_loc[n]`` in the compressed cache), with a per-head sink logit in the
denominator only:

    p_j = exp(s_j - m) / (sum_k exp(s_k - m) + exp(sink_h - m)),   s_j = scale * q . row_j

Two numerics (``reference``):

- fp32: one softmax over every row and the sink, fp32 probabilities in P.V.
- reference (DeepSeek-V4's reference kernel): the rows in its order (window rows valid first,
  each segment in its own order, then the compressed rows), walked in blocks of 64 rows with an
  online softmax whose running max leaves the sink out; the probabilities are rounded to bf16
  for P.V (the denominator sums them unrounded, in fp32); the sink joins the denominator after
  the last block; one rounding of the output.

`sparse_attention_rows` is the math on already dequantized rows (the torch reference, also
used by the model's extend path). The op's torch backend (`sparse_decode_attention_ref`)
dequantizes the rows (`kv_layout.read_kv_rows`) and runs it; its Triton backend
(`decode_attention_triton`) reads the FP8 cache bytes in place. They agree to fp32 rounding (summation order), see the tests.
"""

from __future__ import annotations

import math

import torch

from . import kv_layout
from .backend import resolve
from .checks import check_cache, check_kernel, check_page_size, check_tensor
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from .platform import DIALECTS

OP = "sparse_decode_attention"
ATTN_BLOCK = 64   # rows per block of the reference's sparse attention kernel


def sparse_attention_rows(q: torch.Tensor, kv: list[torch.Tensor], valid: list[torch.Tensor],
                          sink: torch.Tensor, scale: float, reference: bool,
                          window_width: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, 512]; kv: segments of dequantized rows [N, K_i, 512] with valid [N, K_i]
    (window, compressed); sink [H] -> o [N, H, 512] in q's dtype. window_width [N] (reference
    numerics): the window columns, valid rows first, that come before the other segments; the
    window's remaining columns (all invalid) go after them. None: all of them."""
    if reference:
        return _blocks(q, kv, valid, sink, scale, window_width)
    qf = q.float()
    scores = [torch.einsum("nhd,nkd->nhk", qf, rows.float()).mul_(scale)
              .masked_fill_(~ok.unsqueeze(1), float("-inf")) for rows, ok in zip(kv, valid)]
    sink_col = sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    p = _softmax_any_width(torch.cat(scores + [sink_col], -1))
    o = None
    start = 0
    for rows, ok in zip(kv, valid):   # an invalid row adds 0, even a poisoned (NaN) one
        rows = rows.float().masked_fill(~ok.unsqueeze(-1), 0.0)
        part = torch.einsum("nhk,nkd->nhd", p[..., start:start + rows.shape[1]], rows)
        o = part if o is None else o + part
        start += rows.shape[1]
    return o.to(q.dtype)


def _softmax_any_width(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, its bits the same whatever -inf columns the row holds: the max
    is exact, exp is per element and the denominator is summed left to right in fp64 (a
    sequential cumsum, rounded once to fp32), where a column's exp(-inf) = 0 adds exactly
    nothing. A captured graph's rows hold more compressed columns than eager's (its static
    width); torch's softmax sums in an order set by the row's length, so those columns changed
    the denominator's last bit (measured: AVX512, AVX2 and plain kernels alike)."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / torch.cumsum(e.double(), -1)[..., -1:].float()


def _narrow_window_last(window_width: torch.Tensor, n_window: int, n_rows: int) -> torch.Tensor:
    """[N, n_rows] column order that keeps each query's first window_width window columns
    first, then the other segments' columns, then the rest of the window's."""
    col = torch.arange(n_rows, device=window_width.device)
    width = window_width.long()[:, None]
    key = torch.where(col < n_window, torch.where(col < width, col, col + n_rows),
                      col - n_window + width)
    return key.argsort(dim=1)


def _blocks(q, kv, valid, sink, scale, window_width=None):
    """The reference kernel's softmax. Only the two running sums are sequential over blocks:
    the scores, each block's max (the running max is their cumulative max), the probabilities
    and every block's P.V product are computed for all blocks at once, giving the same values
    as block by block."""
    window, window_ok = kv[0], valid[0]
    order = torch.argsort((~window_ok).to(torch.int8), dim=1, stable=True)
    window = window.gather(1, order.unsqueeze(-1).expand(-1, -1, window.shape[-1]))
    rows = torch.cat([window, *kv[1:]], 1)
    ok = torch.cat([window_ok.gather(1, order), *valid[1:]], 1)
    if window_width is not None:
        order = _narrow_window_last(window_width, window.shape[1], rows.shape[1])
        rows = rows.gather(1, order.unsqueeze(-1).expand(-1, -1, rows.shape[-1]))
        ok = ok.gather(1, order)
    pad = -rows.shape[1] % ATTN_BLOCK
    if pad:   # the kernel's last block is whole: padding rows keep its sums' shape
        rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
        ok = torch.nn.functional.pad(ok, (0, pad), value=False)
    rows = rows.float().masked_fill(~ok.unsqueeze(-1), 0.0)
    n, h, d = q.shape
    blocks = rows.shape[1] // ATTN_BLOCK
    s = torch.bmm(q.float(), rows.transpose(1, 2)).masked_fill(~ok.unsqueeze(1), -math.inf)
    s = (s * scale).view(n, h, blocks, ATTN_BLOCK)
    m = torch.cummax(s.amax(-1), dim=-1).values                    # [n, h, blocks]
    alpha = torch.exp(torch.nn.functional.pad(m, (1, -1), value=-math.inf) - m)
    p = torch.exp(s - m.unsqueeze(-1))
    p_sum = p.sum(-1)
    pv = torch.einsum("nhbk,nbkd->nhbd", p.to(torch.bfloat16).float(),
                      rows.view(n, blocks, ATTN_BLOCK, d))
    acc = q.new_zeros(n, h, d, dtype=torch.float32)
    denom = q.new_zeros(n, h, dtype=torch.float32)
    for b in range(blocks):
        denom = denom * alpha[..., b] + p_sum[..., b]
        acc = acc * alpha[..., b, None] + pv[:, :, b]
    denom = denom + torch.exp(sink.float().view(1, -1) - m[..., -1])
    return (acc / denom.unsqueeze(-1)).to(q.dtype)


def sparse_decode_attention_ref(q, swa_cache, window_loc, window_valid, swa_page_size,
                                comp_cache, comp_loc, comp_valid, comp_page_size, sink, scale,
                                reference, dialect):
    """The op's torch backend: the rows dequantized (dialect: the fp8 dialect's name), then
    `sparse_attention_rows`."""
    def rows(cache, loc, ok, page_size):   # an invalid row reads slot 0, whatever its loc
        return kv_layout.read_kv_rows(cache, loc.masked_fill(~ok, 0), page_size,
                                      DIALECTS[dialect])

    kv = [rows(swa_cache, window_loc, window_valid, swa_page_size)]
    valid = [window_valid]
    if comp_cache is not None:
        kv.append(rows(comp_cache, comp_loc, comp_valid, comp_page_size))
        valid.append(comp_valid)
    return sparse_attention_rows(q, kv, valid, sink, scale, reference)


def _fake(q, *args):
    return torch.empty_like(q)


define_op(OP, "(Tensor q, Tensor swa_cache, Tensor window_loc, Tensor window_valid, "
          "int swa_page_size, Tensor? comp_cache, Tensor? comp_loc, Tensor? comp_valid, "
          "int comp_page_size, Tensor sink, float scale, bool reference, str dialect) -> Tensor",
          sparse_decode_attention_ref, _fake,
          triton="decode_attention_triton.sparse_decode_attention_triton")


def _check_cache(prefix: str, cache, page_size, device) -> None:
    check_page_size(page_size, f"{prefix}page_size")
    check_cache(f"{prefix}cache", cache, kv_layout.page_bytes(page_size), page_size, device)


def sparse_decode_attention(q: torch.Tensor, swa_cache: torch.Tensor, window_loc: torch.Tensor,
                            window_valid: torch.Tensor, swa_page_size: int,
                            comp_cache: torch.Tensor | None, comp_loc: torch.Tensor | None,
                            comp_valid: torch.Tensor | None, comp_page_size: int,
                            sink: torch.Tensor, scale: float, reference: bool, *,
                            kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """o [N, H, 512] in q's dtype: q [N, H, 512] (bf16) attending its window rows (SWA cache
    slots window_loc [N, W], valid [N, W]) and compressed rows (comp_loc [N, K] of comp_cache,
    valid [N, K]; comp_cache None: no compressed segment), sink [H] fp32. Invalid rows are
    never read (their loc is 0 by convention); every query must have a valid row (its own
    window slot does). reference: DeepSeek-V4's reference numerics (see above); kernel.backend
    picks the backend."""
    check_kernel(kernel)
    dev = q.device
    check_tensor("q", q, dtypes=(torch.bfloat16, torch.float32),
                 shape=(None, None, kv_layout.HEAD_DIM))
    n, h = q.shape[:2]
    _check_cache("swa_", swa_cache, swa_page_size, dev)
    check_tensor("window_loc", window_loc, dtypes=(torch.int32, torch.int64), shape=(n, None),
                 device=dev)
    check_tensor("window_valid", window_valid, dtype=torch.bool, shape=tuple(window_loc.shape),
                 device=dev)
    if comp_cache is not None:
        _check_cache("comp_", comp_cache, comp_page_size, dev)
        check_tensor("comp_loc", comp_loc, dtypes=(torch.int32, torch.int64), shape=(n, None),
                     device=dev)
        check_tensor("comp_valid", comp_valid, dtype=torch.bool, shape=tuple(comp_loc.shape),
                     device=dev)
    elif comp_loc is not None or comp_valid is not None:
        raise ValueError("comp_loc and comp_valid need comp_cache (None: no compressed rows)")
    check_tensor("sink", sink, dtype=torch.float32, shape=(h,), device=dev)
    if not isinstance(reference, bool):
        raise TypeError(f"reference must be a bool, got {reference!r}")
    return op(OP, resolve(OP, dev, kernel.backend))(
        q.contiguous(), swa_cache, window_loc.contiguous(), window_valid.contiguous(),
        swa_page_size, comp_cache, None if comp_loc is None else comp_loc.contiguous(),
        None if comp_valid is None else comp_valid.contiguous(),
        comp_page_size if comp_cache is not None else 1, sink.contiguous(), float(scale),
        bool(reference), kernel.fp8_dialect.name)
