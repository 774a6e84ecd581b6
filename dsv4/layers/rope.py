"""Rotary embeddings: the reference YaRN frequency table and interleaved (GPT-J style) rotation.

Ratio-0 layers use ``rope_theta`` without YaRN; ratio-4/128 layers use ``compress_rope_theta`` with
YaRN (for Q, their window KV, compressed KV, the indexer and the inverse rotation of the output).
"""

from __future__ import annotations

import math

import torch

from hip_kernels.rotary import apply_rotary_emb, rope_tail  # noqa: F401 (the layers' rotation)


def _correction_dim(rotations: float, dim: int, base: float, max_seq_len: int) -> float:
    return dim * math.log(max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


def find_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float,
                          max_seq_len: int) -> tuple[int, int]:
    """Dims [low, high] over which YaRN ramps from interpolated to original frequencies."""
    low = math.floor(_correction_dim(beta_fast, dim, base, max_seq_len))
    high = math.ceil(_correction_dim(beta_slow, dim, base, max_seq_len))
    return max(low, 0), min(high, dim - 1)


def linear_ramp(low: float, high: float, n: int) -> torch.Tensor:
    if low == high:
        high += 0.001
    return ((torch.arange(n, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def rope_frequencies(dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: float = 32, beta_slow: float = 1) -> torch.Tensor:
    """Per-pair angular frequencies [dim // 2] fp32; YaRN when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_seq_len)
        smooth = 1 - linear_ramp(low, high, dim // 2)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def precompute_freqs_cis(dim: int, max_pos: int, base: float, original_seq_len: int = 0,
                         factor: float = 1.0, beta_fast: float = 32, beta_slow: float = 1,
                         device=None) -> torch.Tensor:
    """complex64 [max_pos, dim // 2]: exp(i * pos * f_k) for every position."""
    freqs = rope_frequencies(dim, base, original_seq_len, factor, beta_fast, beta_slow)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(device)


def layer_freqs_cis(cfg, ratio: int, max_pos: int, device=None) -> torch.Tensor:
    """The table a layer of the given compress ratio uses."""
    if ratio:
        return precompute_freqs_cis(cfg.rope_head_dim, max_pos, cfg.compress_rope_theta,
                                    cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast,
                                    cfg.beta_slow, device)
    return precompute_freqs_cis(cfg.rope_head_dim, max_pos, cfg.rope_theta, device=device)
