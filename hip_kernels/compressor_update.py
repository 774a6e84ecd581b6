"""A KV compressor's step as two dispatcher ops (about fifty torch ops unfused):

- `torch.ops.dsv4.compressor_project`: each new token's (kv, score) row, fp32
  [N, 2 * width] = [x @ wkv^T | x @ wgate^T] (x in fp32): the raw gate output, no position
  bias. This is the row the state ring keeps, as SGLang's ring keeps it, so a ring written by
  either can be pooled by the other.
- `torch.ops.dsv4.compressor_update`: for each candidate window (M of them, M = 0 on a step
  where none closes), gather its rows from the state ring or from this step's rows, add the
  position bias to their scores (the window's j-th row, in position order, gets ape[j % ratio]:
  windows start at multiples of ratio, so j % ratio is the row's position % ratio), pool them
  (softmax of the scores over the window, per channel; with overlap the previous window's A
  halves and this window's B halves, a missing previous window ignored), round to the model
  dtype, RMSNorm, RoPE at the window's first position and, for the indexer's compressor, the
  Hadamard rotation and the FP4 simulation; then write this step's rows into the ring (in place,
  after the pool has read it). Returns the M compressed rows; the caller stores them (the cache's
  quantization is the set-KV family's).

The torch references (CPU path and oracle) are the model's expressions, so its bits are
unchanged: the score the softmax sees is the same fp32 sum gate + ape, made at the pool instead
of at the projection. The Triton kernels (`compressor_update_triton`: one launch for the
projection, two for the update, the ring write after the pool) sum in their own order and agree
with the references to a stated tolerance; their ring write is exact. Each public wrapper
resolves the backend from its KernelOptions (no HIP version).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation_sim import FP4_BLOCK, fp4_quant_dequant, hadamard_rotate
from .backend import resolve
from .checks import check_kernel, check_tensor
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from .rms_norm import rms_norm_ref
from .rotary import rope_tail


def compressor_project_ref(x: torch.Tensor, wkv: torch.Tensor,
                           wgate: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return torch.cat([F.linear(xf, wkv), F.linear(xf, wgate)], 1)


def pool_windows(kv: torch.Tensor, score: torch.Tensor, has_prev: torch.Tensor | None,
                 head_dim: int, ratio: int, overlap: bool) -> torch.Tensor:
    """kv, score [M, window_rows, coff * d] in position order (with overlap the first ``ratio``
    rows are the previous window; has_prev [M] says whether it exists; score with the position
    bias added) -> fp32 [M, d]."""
    if overlap:
        d, r = head_dim, ratio
        kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], 1)
        score = torch.cat([score[:, :r, :d], score[:, r:, d:]], 1)
        if has_prev is not None:
            drop = torch.zeros(kv.shape[:2], dtype=torch.bool, device=kv.device)
            drop[:, :r] = ~has_prev.view(-1, 1)
            kv = kv.masked_fill(drop.unsqueeze(-1), 0.0)
            score = score.masked_fill(drop.unsqueeze(-1), float("-inf"))
    return (kv * score.softmax(dim=1)).sum(dim=1)


def finish_rows(pooled: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                freqs_cis: torch.Tensor, rope_dim: int, rotate: bool, dtype: torch.dtype,
                reference: bool) -> torch.Tensor:
    """Pooled fp32 rows [M, d] -> compressed rows in dtype: norm, RoPE (freqs_cis [M, rope/2]),
    and with rotate the Hadamard rotation (reference numerics' order when reference) + FP4."""
    kv = rms_norm_ref(pooled.to(dtype), norm_weight, eps)
    kv = rope_tail(kv, freqs_cis, rope_dim)
    if rotate:
        kv = fp4_quant_dequant(hadamard_rotate(kv, reference))
    return kv


def window_ape(ape: torch.Tensor, window_rows: int) -> torch.Tensor:
    """The position bias of a window's rows [window_rows, width]: row j (position order) gets
    ape[j % ratio], its position's phase (windows start at multiples of ratio)."""
    return ape[torch.arange(window_rows, device=ape.device) % ape.shape[0]]


def compressor_update_ref(new, state, src_state, src_new, has_prev, window_start, state_write,
                          ape, freqs_table, norm_weight, eps, ratio, head_dim, rope_dim, overlap,
                          rotate, reference, dtype):
    width = new.shape[1] // 2
    if src_state.shape[0]:
        from_new = (src_new >= 0).unsqueeze(-1)
        rows = torch.where(from_new, new[src_new.clamp(min=0)], state[src_state.clamp(min=0)])
        score = rows[..., width:] + window_ape(ape, src_state.shape[1])
        pooled = pool_windows(rows[..., :width], score, has_prev, head_dim, ratio, overlap)
        out = finish_rows(pooled, norm_weight, eps, freqs_table[window_start.clamp(min=0)],
                          rope_dim, rotate, dtype, reference).contiguous()
    else:
        out = new.new_empty(0, head_dim, dtype=dtype)
    keep = state_write >= 0
    state.index_copy_(0, torch.where(keep, state_write, state.shape[0] - 1), new)
    return out


def _project_fake(x, wkv, wgate):
    return x.new_empty(x.shape[0], 2 * wkv.shape[0], dtype=torch.float32)


def _update_fake(new, state, src_state, src_new, has_prev, window_start, state_write, ape,
                 freqs_table, norm_weight, eps, ratio, head_dim, rope_dim, overlap, rotate,
                 reference, dtype):
    return new.new_empty(src_state.shape[0], head_dim, dtype=dtype)


define_op("compressor_project", "(Tensor x, Tensor wkv, Tensor wgate) -> Tensor",
          compressor_project_ref, _project_fake,
          triton="compressor_update_triton.compressor_project_triton")
define_op("compressor_update", "(Tensor new, Tensor(a!) state, Tensor src_state, "
          "Tensor src_new, Tensor has_prev, Tensor window_start, Tensor state_write, Tensor ape, "
          "Tensor freqs_table, Tensor norm_weight, float eps, int ratio, int head_dim, "
          "int rope_dim, bool overlap, bool rotate, bool reference, ScalarType dtype) -> Tensor",
          compressor_update_ref, _update_fake,
          triton="compressor_update_triton.compressor_update_triton")


def _update_triton_ok(state: torch.Tensor, head_dim: int, rope_dim: int, rotate: bool) -> bool:
    """What the Triton kernel covers: a power-of-two head_dim (a register row), an even
    rope_dim within it, a multiple of the FP4 block when rotating, ring rows of unit stride."""
    return (head_dim > 0 and not head_dim & (head_dim - 1) and 0 < rope_dim <= head_dim
            and rope_dim % 2 == 0 and (not rotate or head_dim % FP4_BLOCK == 0)
            and state.stride(1) == 1)


def compressor_project(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, *,
                       kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """fp32 [N, 2 * width] (kv | score, the raw gate output: no position bias) of x [N, dim]
    with the fp32 weights wkv, wgate [width, dim]. kernel.backend picks the backend (no HIP
    version)."""
    check_kernel(kernel)
    check_tensor("x", x, dim=2)
    check_tensor("wkv", wkv, dtype=torch.float32, shape=(None, x.shape[1]), device=x.device)
    check_tensor("wgate", wgate, dtype=torch.float32, shape=tuple(wkv.shape), device=x.device)
    backend = resolve("compressor_project", x.device, kernel.backend)
    return op("compressor_project", backend)(x.contiguous(), wkv.contiguous(), wgate.contiguous())


def compressor_update(new: torch.Tensor, state: torch.Tensor, plan, ape: torch.Tensor,
                      freqs_table: torch.Tensor, norm_weight: torch.Tensor, eps: float, *,
                      ratio: int, head_dim: int,
                      rope_dim: int, overlap: bool, rotate: bool, reference: bool,
                      dtype: torch.dtype, kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
                      ) -> torch.Tensor:
    """The M compressed rows [M, head_dim] in dtype of the plan's candidate windows, and this
    step's rows new [N, 2 * width] written into the ring state [rows, 2 * width] (fp32, in
    place) at plan.state_write (-1: not kept). plan: the step's compressor plan for this ratio
    (src_state, src_new [M, R], has_prev, window_start [M], state_write [N]); ape: the
    position bias [ratio, width], fp32, added to the window rows' scores at the pool (the ring
    keeps them without it); freqs_table: the layer's RoPE table [positions, rope_dim / 2].
    kernel.backend picks the backend (no HIP version); a head_dim / rope_dim the Triton kernel
    does not cover runs the torch reference."""
    check_kernel(kernel)
    check_tensor("new", new, dtype=torch.float32, dim=2)
    if new.shape[1] != 2 * (2 if overlap else 1) * head_dim:
        raise ValueError(f"new must have 2 * {2 if overlap else 1} * head_dim = "
                         f"{2 * (2 if overlap else 1) * head_dim} columns, got {new.shape[1]}")
    check_tensor("state", state, dtype=torch.float32, shape=(None, new.shape[1]),
                 device=new.device)
    m = plan.src_state.shape[0]
    check_tensor("plan.src_new", plan.src_new, shape=tuple(plan.src_state.shape),
                 device=new.device)
    check_tensor("plan.state_write", plan.state_write, shape=(new.shape[0],), device=new.device)
    check_tensor("plan.window_start", plan.window_start, shape=(m,), device=new.device)
    check_tensor("plan.has_prev", plan.has_prev, dtype=torch.bool, shape=(m,), device=new.device)
    check_tensor("ape", ape, dtype=torch.float32, shape=(ratio, new.shape[1] // 2),
                 device=new.device)
    check_tensor("freqs_table", freqs_table, dtype=torch.complex64, shape=(None, rope_dim // 2),
                 device=new.device)
    check_tensor("norm_weight", norm_weight, shape=(head_dim,), device=new.device)
    backend = resolve("compressor_update", new.device, kernel.backend,
                      triton_ok=_update_triton_ok(state, head_dim, rope_dim, rotate))
    return op("compressor_update", backend)(
        new.contiguous(), state, plan.src_state.contiguous(), plan.src_new.contiguous(),
        plan.has_prev.contiguous(), plan.window_start.contiguous(),
        plan.state_write.contiguous(), ape.contiguous(), freqs_table.contiguous(),
        norm_weight.contiguous(), float(eps), ratio, head_dim, rope_dim, overlap, rotate,
        reference, dtype)
