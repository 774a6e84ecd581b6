"""MQA attention of DeepSeek-V4: one shared 512-wide KV row per token (K = V), per-head sinks.

The module holds the parameters and the math of each step; where KV rows live (the paged caches)
is the caller's business:

1. ``project_q``: ``qr = q_norm(wq_a(x))``, ``q = wq_b(qr)`` as [N, H, 512] (before its norm;
   the weightless per-head RMSNorm and the RoPE on dims 448..511 are fused into the window
   store, ``hip_kernels.set_kv``).
2. ``project_kv``: ``wkv(x)`` [N, 512]; kv_norm, RoPE and the FP8 simulation of the nope dims are
   the window store's (the cache's quantization).
3. ``sparse_attention``: one softmax over the gathered row segments (window, compressed) with the
   head's sink in the denominator (reference numerics: in the reference kernel's row order and
   64-row blocks, bf16 probabilities in P.V; fp32: one pass, fp32 probabilities).
4. ``project_out``: inverse RoPE on o[..., 448:], grouped low-rank ``wo_a``, then ``wo_b``.
"""

from __future__ import annotations

import torch
from torch import nn

from hip_kernels.decode_attention import sparse_attention_rows
from hip_kernels.grouped_out_proj import grouped_out_proj
from hip_kernels.options import DEFAULT_KERNEL_OPTIONS, KernelOptions

from ..parallel import SINGLE, TensorSplit, partial_dtype, sum_over_ranks
from .compressor import Compressor
from .indexer import Indexer
from .linear import Linear
from .norm import RMSNorm
from .quant_linear import make_linear


class Attention(nn.Module):
    def __init__(self, cfg, layer_id: int, dtype: torch.dtype = torch.bfloat16, device=None,
                 native: bool = False, split: TensorSplit = SINGLE):
        """native: wq_a, wq_b, wkv, wo_b (and the indexer's wq_b) hold FP8 weights and compute as
        the reference's FP8 linear; wo_a stays bf16, as the reference computes it. split: this
        tensor-parallel rank's heads and output groups (n_heads, n_groups, the sinks, wq_b and
        wo_a rows, wo_b columns are its part; ``sum_partial_output`` adds the ranks' wo_b)."""
        super().__init__()
        self.layer_id = layer_id
        self.split = split
        self.n_heads = split.part(cfg.n_heads, "n_heads")
        self.head_dim = cfg.head_dim
        self.rope_dim = cfg.rope_head_dim
        self.n_groups = split.part(cfg.o_groups, "o_groups")
        self.o_lora_rank = cfg.o_lora_rank
        self.window_size = cfg.window_size
        self.ratio = cfg.layer_ratio(layer_id)
        self.eps = cfg.norm_eps
        self.softmax_scale = self.head_dim ** -0.5

        def linear(i, o):
            return make_linear(i, o, native, dtype, device)

        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32, device=device))
        self.wq_a = linear(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, self.eps, device=device)
        self.wq_b = linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = linear(cfg.dim, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps, device=device)
        self.wo_a = Linear(self.n_heads * self.head_dim // self.n_groups,
                           self.n_groups * self.o_lora_rank, dtype=dtype, device=device)
        self.wo_b = linear(self.n_groups * self.o_lora_rank, cfg.dim)
        self.compressor = (Compressor(cfg.dim, self.head_dim, self.rope_dim, self.ratio, self.eps,
                                      device=device) if self.ratio else None)
        self.indexer = Indexer(cfg, dtype, device, native, split) if self.ratio == 4 else None

    def project_q(self, x: torch.Tensor, kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, H, 512] before its norm, qr [N, q_lora_rank]). kernel: the FP8 linears'."""
        qr = self.q_norm(self.wq_a(x, kernel), kernel)
        return self.wq_b(qr, kernel).unflatten(-1, (self.n_heads, self.head_dim)), qr

    def project_kv(self, x: torch.Tensor,
                   kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
        return self.wkv(x, kernel)

    def sparse_attention(self, q: torch.Tensor, kv: list[torch.Tensor],
                         valid: list[torch.Tensor], reference: bool,
                         window_width: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, H, 512]; kv: segments of dequantized rows [N, K_i, 512] with valid [N, K_i]
        (window, compressed) -> o [N, H, 512] in q's dtype, one softmax over all segments:
        p_j = exp(s_j - m) / (sum_k exp(s_k - m) + exp(sink_h - m)), in the reference numerics'
        rounding when reference, else in fp32 (``hip_kernels.decode_attention``; over the paged
        caches the model calls its op, which reads the FP8 rows in place). window_width [N]:
        the window columns before the compressed rows (an extend's, see AttentionMetadata)."""
        return sparse_attention_rows(q, kv, valid, self.attn_sink, self.softmax_scale, reference,
                                     window_width)

    def project_out(self, o: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
                    kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
        """[N, H, 512] -> [N, dim]: inverse RoPE (the table freqs_cis at the token positions)
        + grouped wo_a (one op, ``hip_kernels.grouped_out_proj``), wo_b."""
        t = grouped_out_proj(o, freqs_cis, positions, self.wo_a.weight, self.n_groups,
                             self.rope_dim, kernel=kernel)
        partial = self.wo_b(t, kernel, out_dtype=partial_dtype(t.dtype, self.split))
        return self.sum_partial_output(partial).to(t.dtype)

    def sum_partial_output(self, y: torch.Tensor) -> torch.Tensor:
        """wo_b's output summed over the tensor-parallel ranks (each holds some of its input
        columns: the reference's RowParallelLinear all_reduce; under a split each rank's part is
        fp32, not rounded, and the sum is rounded once, as one rank's wo_b rounds); y itself on
        one rank."""
        return sum_over_ranks(y, self.split)
