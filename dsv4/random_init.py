"""Seeded random weights with scales that keep a DeepSeek-V4 stack numerically lively: unit-ish
activations, attention that is neither uniform nor one-hot, non-trivial routing and mixing.

Used for tests, benchmarks and the CLI's default model (no downloads). Deterministic for a seed.
"""

from __future__ import annotations

import torch
from torch import nn


def _normal_(p: torch.Tensor, g: torch.Generator, std: float, mean: float = 0.0) -> None:
    with torch.no_grad():
        p.copy_((torch.randn(p.shape, generator=g) * std + mean).to(p.dtype))


def init_random_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter and buffer of a DeepseekV4Model in place (CPU generator, so the values
    do not depend on the device). Returns the model."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    hc = cfg.hc_mult
    for name, p in sorted(model.state_dict(keep_vars=True).items()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":
            with torch.no_grad():
                ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:p.shape[1]]
                                   for _ in range(p.shape[0])])
                p.copy_(ids)
        elif name.endswith("norm.weight"):
            _normal_(p, g, 0.1, 1.0)
        elif leaf == "attn_sink":
            _normal_(p, g, 1.0, 1.0)
        elif leaf == "ape":
            _normal_(p, g, 0.5)
        elif leaf == "bias":
            _normal_(p, g, 0.1)
        elif "hc_" in leaf and leaf.endswith("_fn"):
            _normal_(p, g, p.shape[1] ** -0.5)
        elif "hc_" in leaf and leaf.endswith("_scale"):
            _normal_(p, g, 0.1, 0.5)
        elif "hc_" in leaf and leaf.endswith("_base"):
            _normal_(p, g, 0.5)
            if p.numel() == (2 + hc) * hc:
                with torch.no_grad():  # lean comb towards the identity (a residual stream)
                    p[2 * hc:] += 2.0 * torch.eye(hc, device=p.device).flatten().to(p.dtype)
        elif name == "embed.weight":
            _normal_(p, g, 1.0)
        elif p.dim() == 2:
            _normal_(p, g, p.shape[1] ** -0.5)
        else:
            raise ValueError(f"init_random_weights: no rule for {name} {tuple(p.shape)}")
    return model
