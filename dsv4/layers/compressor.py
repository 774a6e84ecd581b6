"""The KV compressors: learned gated pooling of ``ratio`` consecutive tokens into one KV row.

Per token t: ``kv_t = wkv(x_t)`` and ``score_t = wgate(x_t) + ape[t % ratio]`` (fp32, x is the
attn-normed layer input). At a window's last token, per channel, the rows of the window are
averaged with softmax(score) weights:

- ratio 128 (HCA): over the window's 128 rows [512].
- ratio 4 (CSA, "overlap"): rows are 2 x d wide, [A | B]; the pool runs over 8 entries, the
  previous window's A halves and the current window's B halves (no previous window: B only).

The pooled row is rounded to the model dtype, RMSNorm-ed, rotated at the window's first position
and, for the indexer's compressor (``rotate=True``), Hadamard-rotated and FP4-simulated. The row
is then stored at compressed index ``t // ratio``; the FP8 simulation of attention rows is the
cache's quantization and happens at the store.
"""

from __future__ import annotations

import torch
from torch import nn

from hip_kernels.activation_sim import fp4_quant_dequant, hadamard_rotate

from .linear import Linear
from .norm import RMSNorm
from .rope import rope_tail


class Compressor(nn.Module):
    def __init__(self, dim: int, head_dim: int, rope_dim: int, ratio: int, norm_eps: float,
                 rotate: bool = False, device=None):
        super().__init__()
        if ratio not in (4, 128):
            raise ValueError(f"compress ratio must be 4 or 128, got {ratio}")
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        self.ratio = ratio
        self.overlap = ratio == 4
        self.rotate = rotate
        width = self.coff * head_dim
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32, device=device))
        self.wkv = Linear(dim, width, dtype=torch.float32, device=device)
        self.wgate = Linear(dim, width, dtype=torch.float32, device=device)
        self.norm = RMSNorm(head_dim, norm_eps, device=device)

    @property
    def coff(self) -> int:
        """Row width in head_dims: 2 ([A | B]) with overlap, else 1."""
        return 2 if self.overlap else 1

    @property
    def window_rows(self) -> int:
        """Rows one pool reads: previous + current window with overlap, else one window."""
        return self.coff * self.ratio

    def project(self, x: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv [N, coff*d] and score [N, coff*d] (ape included), fp32."""
        xf = x.float()
        return self.wkv(xf), self.wgate(xf) + self.ape[positions.long() % self.ratio]

    def pool(self, kv: torch.Tensor, score: torch.Tensor,
             has_prev: torch.Tensor | None = None) -> torch.Tensor:
        """Pool windows: kv, score [M, window_rows, coff*d] in position order (with overlap the
        first ``ratio`` rows are the previous window); has_prev [M] bool says whether that previous
        window exists (rows of a missing one are ignored, whatever they hold). fp32 [M, d]."""
        if self.overlap:
            d, r = self.head_dim, self.ratio
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], 1)
            score = torch.cat([score[:, :r, :d], score[:, r:, d:]], 1)
            if has_prev is not None:
                drop = torch.zeros(kv.shape[:2], dtype=torch.bool, device=kv.device)
                drop[:, :r] = ~has_prev.view(-1, 1)
                kv = kv.masked_fill(drop.unsqueeze(-1), 0.0)
                score = score.masked_fill(drop.unsqueeze(-1), float("-inf"))
        return (kv * score.softmax(dim=1)).sum(dim=1)

    def finish(self, pooled: torch.Tensor, freqs_cis: torch.Tensor, dtype: torch.dtype,
               reference: bool) -> torch.Tensor:
        """Compressed rows [M, d] in dtype: norm, RoPE at the window start (freqs_cis [M, rope/2])
        and, for the indexer, Hadamard rotation (in the reference numerics' order when
        reference) and FP4 simulation."""
        kv = self.norm(pooled.to(dtype))
        kv = rope_tail(kv, freqs_cis, self.rope_dim)
        if self.rotate:
            kv = fp4_quant_dequant(hadamard_rotate(kv, reference))
        return kv
