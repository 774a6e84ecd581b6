"""The first half of the attention's output projection, as one dispatcher op
(`torch.ops.dsv4.grouped_out_proj`): the inverse RoPE of each head's last rope_dim dims, then the
grouped low-rank ``wo_a`` (the heads split into G groups, group g's flattened heads times its own
[R, H * D / G] block of the weight). ``wo_b`` follows as its own linear (it may be FP8, and a
tensor-parallel all_reduce follows it).

The RoPE factors are the rows of the RoPE table at each token's position, read by the op. The
torch reference (CPU path and oracle) is the model's expression (``rotary.rope_tail`` with the
conjugate, an einsum over the groups), so the model's bits are unchanged. The Triton kernel
(`grouped_out_proj_triton`, one launch) applies the inverse RoPE to each tile of o as it loads
it (the reference's roundings, the same bits) and multiplies it with the group's weight block
in a tl.dot with an fp32 accumulator: the same exact products, summed in another order, so it
agrees with the reference to one rounding of o's dtype, not bit for bit.
"""

from __future__ import annotations

import torch

from .backend import resolve
from .checks import check_kernel, check_positions, check_tensor
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from .rotary import rope_tail

OP = "grouped_out_proj"


def grouped_out_proj_ref(o: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
                         weight: torch.Tensor, n_groups: int, rope_dim: int) -> torch.Tensor:
    o = rope_tail(o, freqs_cis[positions.long()], rope_dim, inverse=True)
    o = o.flatten(1).unflatten(-1, (n_groups, -1))
    w = weight.view(n_groups, weight.shape[0] // n_groups, -1)
    return torch.einsum("ngd,grd->ngr", o, w).flatten(1)


def _fake(o, freqs_cis, positions, weight, n_groups, rope_dim):
    return o.new_empty(o.shape[0], weight.shape[0])


define_op(OP, "(Tensor o, Tensor freqs_cis, Tensor positions, Tensor weight, int n_groups, "
          "int rope_dim) -> Tensor", grouped_out_proj_ref, _fake,
          triton="grouped_out_proj_triton.grouped_out_proj_triton")


def grouped_out_proj(o: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
                     weight: torch.Tensor, n_groups: int, rope_dim: int, *,
                     kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """[N, n_groups * R] in o's dtype from the attention output o [N, H, D], the RoPE table
    freqs_cis [P, rope_dim / 2] (complex64, applied conjugated) at each token's position
    (positions [N], int32 or int64, each below P: range-checked unless value checks are off)
    and wo_a's weight [n_groups * R, H * D / n_groups] (o's dtype)."""
    check_kernel(kernel)
    check_tensor("o", o, dtypes=(torch.bfloat16, torch.float16, torch.float32), dim=3)
    n, h, d = o.shape
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1 \
            or h % n_groups:
        raise ValueError(f"n_groups={n_groups!r}: expected an int >= 1 dividing the {h} heads")
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or not 0 < rope_dim <= d \
            or rope_dim % 2:
        raise ValueError(f"rope_dim={rope_dim!r}: expected an even int in (0, {d}]")
    check_tensor("freqs_cis", freqs_cis, dtype=torch.complex64, shape=(None, rope_dim // 2),
                 device=o.device)
    check_positions(positions, n, freqs_cis.shape[0], o.device, kernel)
    check_tensor("weight", weight, dtype=o.dtype, shape=(None, h * d // n_groups),
                 device=o.device)
    if weight.shape[0] % n_groups:
        raise ValueError(f"weight's {weight.shape[0]} rows must split into {n_groups} groups")
    # the kernel rotates aligned pairs of a tile: an odd head dim runs the reference
    backend = resolve(OP, o.device, kernel.backend, triton_ok=d % 2 == 0)
    return op(OP, backend)(o.contiguous(), freqs_cis.contiguous(), positions.contiguous(),
                           weight.contiguous(), n_groups, rope_dim)
