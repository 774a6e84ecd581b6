"""The lightning indexer's query after its projection, as one dispatcher op
(`torch.ops.dsv4.indexer_query`): per head, RoPE on the last rope_dim dims at the token's
position (its row of the RoPE table, read by the op), the Walsh-Hadamard rotation and the FP4
simulation (about forty torch ops unfused).

The torch reference (CPU path and oracle) is the model's chain of ``rotary.rope_tail``,
``activation_sim.hadamard_rotate`` and ``activation_sim.fp4_quant_dequant``, so the model's bits
are unchanged. The Triton kernel (`indexer_query_triton`, one launch) keeps a block of heads'
rows in registers through the chain and rounds where the reference rounds: the RoPE and the
FP4 simulation give the reference's bits for the same finite input, and so does the rotation
in the reference numerics (the same butterflies). In fp32 numerics the reference rotates with
one fp32 GEMM and the kernel with the same butterflies: the rotated values agree to fp32
rounding, so a value next to a rounding boundary (the rounding after the rotation, an FP4 tie)
may round the other way.
"""

from __future__ import annotations

import torch

from .activation_sim import fp4_quant_dequant, hadamard_rotate
from .backend import resolve
from .checks import check_kernel, check_positions, check_tensor
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from .rotary import rope_tail

OP = "indexer_query"


def indexer_query_ref(q: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
                      n_heads: int, rope_dim: int, reference: bool) -> torch.Tensor:
    q = rope_tail(q.unflatten(-1, (n_heads, -1)), freqs_cis[positions.long()], rope_dim)
    return fp4_quant_dequant(hadamard_rotate(q, reference))


def _fake(q, freqs_cis, positions, n_heads, rope_dim, reference):
    return q.new_empty(q.shape[0], n_heads, q.shape[1] // n_heads)


define_op(OP, "(Tensor q, Tensor freqs_cis, Tensor positions, int n_heads, int rope_dim, "
          "bool reference) -> Tensor", indexer_query_ref, _fake,
          triton="indexer_query_triton.indexer_query_triton")


def indexer_query(q: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
                  n_heads: int, rope_dim: int, *, reference: bool,
                  kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """Index queries [N, n_heads, D] in q's dtype from the projection q [N, n_heads * D] (bf16) and
    the RoPE table freqs_cis [P, rope_dim / 2] (complex64) at each token's position (positions
    [N], int32 or int64, each below P: range-checked unless value checks are off). D a power of
    two and a multiple of 32 (the FP4 block). reference: DeepSeek-V4's reference numerics (the
    rotation's butterflies) or fp32."""
    check_kernel(kernel)
    check_tensor("q", q, dtypes=(torch.bfloat16, torch.float16, torch.float32), dim=2)
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1 \
            or q.shape[1] % n_heads:
        raise ValueError(f"n_heads={n_heads!r}: expected an int >= 1 dividing q's width "
                         f"{q.shape[1]}")
    d = q.shape[1] // n_heads
    if d & (d - 1) or d % 32:
        raise ValueError(f"q's head dim must be a power of two and a multiple of 32, got {d}")
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or not 0 < rope_dim <= d \
            or rope_dim % 2:
        raise ValueError(f"rope_dim={rope_dim!r}: expected an even int in (0, {d}]")
    check_tensor("freqs_cis", freqs_cis, dtype=torch.complex64, shape=(None, rope_dim // 2),
                 device=q.device)
    check_positions(positions, q.shape[0], freqs_cis.shape[0], q.device, kernel)
    if not isinstance(reference, bool):
        raise TypeError(f"reference must be a bool, got {reference!r}")
    backend = resolve(OP, q.device, kernel.backend)
    return op(OP, backend)(q.contiguous(), freqs_cis.contiguous(), positions.contiguous(),
                           n_heads, rope_dim, reference)
