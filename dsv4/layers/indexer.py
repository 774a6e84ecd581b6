"""The lightning indexer of CSA (ratio-4) layers: picks which compressed rows a query attends.

``q = wq_b(qr)`` per index head [Hi, 128], RoPE on its last 64 dims, Hadamard rotation, FP4
simulation; keys come from the indexer's own ratio-4 compressor (head_dim 128, same treatment).
``score[t] = sum_h relu(q_h . k_t) * w_h`` with ``w = weights_proj(x) * 128^-0.5 * Hi^-0.5``; the
top ``index_topk`` visible rows are kept (all of them when there are no more than that). The
scores are computed over the paged key cache by ``hip_kernels.indexer_scores`` (one op), which
applies the weights' scale (``weight_scale``) itself.
In reference numerics (``reference=True``) the weights, the q.k products, the weighting and the
head sum are each rounded to the model dtype (bf16), as the reference computes them; in fp32
numerics they stay fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from hip_kernels import aiter_ops
from hip_kernels.indexer_query import indexer_query
from hip_kernels.plain_linear import plain_linear
from hip_kernels.indexer_topk import indexer_topk
from hip_kernels.options import DEFAULT_KERNEL_OPTIONS, KernelOptions

from ..options import Options
from ..parallel import SINGLE, TensorSplit, sum_over_ranks
from .compressor import Compressor
from .linear import Linear
from .quant_linear import make_linear


class Indexer(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype = torch.bfloat16, device=None,
                 native: bool = False, split: TensorSplit = SINGLE):
        """split: this tensor-parallel rank's index heads (wq_b and weights_proj rows);
        n_heads stays the model's count (it scales the weights), n_local_heads is the rank's."""
        super().__init__()
        self.split = split
        self.n_heads = cfg.index_n_heads
        self.weight_scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        self.n_local_heads = split.part(cfg.index_n_heads, "index_n_heads")
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.rope_head_dim
        self.topk = cfg.index_topk
        self.ratio = 4
        self.wq_b = make_linear(cfg.q_lora_rank, self.n_local_heads * self.head_dim, native,
                                dtype, device)
        self.weights_proj = Linear(cfg.dim, self.n_local_heads, dtype=dtype, device=device)
        self.compressor = Compressor(cfg.dim, self.head_dim, self.rope_dim, self.ratio,
                                     cfg.norm_eps, rotate=True, device=device)

    def project_q(self, qr: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
                  reference: bool, kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
                  ) -> torch.Tensor:
        """Index queries [N, Hi, 128] (RoPE from the table freqs_cis at the token positions,
        rotated, FP4-simulated: one op after wq_b, ``hip_kernels.indexer_query``)."""
        return indexer_query(self.wq_b(qr, kernel), freqs_cis, positions, self.n_local_heads,
                             self.rope_dim, reference=reference, kernel=kernel)

    def head_weights(self, x: torch.Tensor, reference: bool,
                     kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
        """Per-head weights [N, Hi] before their scale (``weight_scale``, applied by the scores
        op): bf16 (the model dtype) in reference numerics, else fp32. weights_proj stays in bf16
        as the checkpoint keeps it, one op (``hip_kernels.plain_linear``: a Triton kernel on a
        GPU, so a layer of native weights runs no torch GEMM)."""
        w = plain_linear(x, self.weights_proj.weight, kernel=kernel)
        return w if reference else w.float()

    def select(self, scores: torch.Tensor, visible: torch.Tensor, options: Options,
               width: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k of scores [N, T] among visible [N, T] rows: int64 [N, min(topk, T)], -1 where a
        query has fewer visible rows than that (on aiter where options allow it): one op,
        ``hip_kernels.indexer_topk``. width [N]: each query's candidate count as the reference
        has it (columns past it, a graph's padding, change nothing)."""
        scores = self.sum_scores_over_ranks(scores)
        k = min(self.topk, scores.shape[1])
        use_aiter = aiter_ops.topk_uses_aiter(scores, k, numerics=options.numerics,
                                              kernel=options.kernel)
        return indexer_topk(scores, visible, k, use_aiter=use_aiter, width=width,
                            kernel=options.kernel)

    def sum_scores_over_ranks(self, scores: torch.Tensor) -> torch.Tensor:
        """Each rank's scores sum its own heads: the ranks add them before the top-k (the
        reference's all_reduce of index_score); scores itself on one rank."""
        return sum_over_ranks(scores, self.split)
