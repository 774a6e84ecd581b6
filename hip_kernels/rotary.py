"""The interleaved (GPT-J style) rotation of DeepSeek-V4's RoPE, shared by the model's layers and
the fused ops that contain it. The frequency tables are the model's (``dsv4.layers.rope``)."""

from __future__ import annotations

import torch


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor,
                     inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [N, ..., 2K] by freqs_cis [N, K].

    The product is taken in fp32 and rounded to x's dtype; ``inverse`` uses the conjugate.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    f = freqs_cis.conj() if inverse else freqs_cis
    f = f.view(f.shape[0], *([1] * (xc.dim() - 2)), f.shape[-1])
    return torch.view_as_real(xc * f).flatten(-2).to(x.dtype)


def rope_tail(x: torch.Tensor, freqs_cis: torch.Tensor, rope_dim: int,
              inverse: bool = False) -> torch.Tensor:
    """x with apply_rotary_emb on its last rope_dim dims (a new tensor)."""
    rotated = apply_rotary_emb(x[..., -rope_dim:], freqs_cis, inverse)
    return torch.cat([x[..., :-rope_dim], rotated], -1)
