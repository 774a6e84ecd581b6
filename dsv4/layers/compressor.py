"""The KV compressors: learned gated pooling of ``ratio`` consecutive tokens into one KV row.

Per token t: ``kv_t = wkv(x_t)`` and ``score_t = wgate(x_t) + ape[t % ratio]`` (fp32, x is the
attn-normed layer input). At a window's last token, per channel, the rows of the window are
averaged with softmax(score) weights:

- ratio 128 (HCA): over the window's 128 rows [512].
- ratio 4 (CSA, "overlap"): rows are 2 x d wide, [A | B]; the pool runs over 8 entries, the
  previous window's A halves and the current window's B halves (no previous window: B only).

The state ring keeps each token's ``kv_t`` and its raw gate output ``wgate(x_t)``; the position
bias ``ape`` is added when a window is pooled (SGLang's ring holds the same, so a ring either
one wrote can be pooled by the other).

The pooled row is rounded to the model dtype, RMSNorm-ed, rotated at the window's first position
and, for the indexer's compressor (``rotate=True``), Hadamard-rotated and FP4-simulated. The row
is then stored at compressed index ``t // ratio``; the FP8 simulation of attention rows is the
cache's quantization and happens at the store.
"""

from __future__ import annotations

import torch
from torch import nn

from hip_kernels.compressor_update import compressor_project, compressor_update
from hip_kernels.options import DEFAULT_KERNEL_OPTIONS, KernelOptions

from .linear import Linear
from .norm import RMSNorm


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
                kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
        """This step's rows [N, 2 * coff*d]: kv | score (the raw gate output, ape not added:
        the row the ring keeps), fp32 (one op, ``hip_kernels.compressor_project``)."""
        return compressor_project(x, self.wkv.weight, self.wgate.weight, kernel=kernel)

    def update(self, new: torch.Tensor, state: torch.Tensor, plan, freqs_cis: torch.Tensor,
               dtype: torch.dtype, reference: bool,
               kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
        """Compressed rows [M, d] in dtype of the plan's candidate windows (pooled from the
        ring state and this step's rows new, ape added to their scores, then finished: see the
        module docstring), and new kept in the ring at plan.state_write; one op
        (``hip_kernels.compressor_update``).
        freqs_cis: the layer's RoPE table; reference: the reference numerics."""
        return compressor_update(new, state, plan, self.ape, freqs_cis, self.norm.weight,
                                 self.norm.eps,
                                 ratio=self.ratio, head_dim=self.head_dim,
                                 rope_dim=self.rope_dim, overlap=self.overlap,
                                 rotate=self.rotate, reference=reference, dtype=dtype,
                                 kernel=kernel)
