"""Seeded random weights with scales that keep a DeepSeek-V4 stack numerically lively: unit-ish
activations, attention that is neither uniform nor one-hot, non-trivial routing and mixing.

Used for tests, benchmarks and the CLI's default model (no downloads). Deterministic for a seed.
A model holding the published formats (``weights="native"``) draws the same bf16 values and
quantizes them as the checkpoints are, so its FP8/FP4 weights are those of the bf16 model of the
same seed saved quantized (its bf16 ``wo_a`` is the bf16 model's; a checkpoint stores it FP8).
"""

from __future__ import annotations

import torch
from torch import nn

from .weights import native


def _normal(shape, g: torch.Generator, std: float, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=g) * std + mean


def _normal_(p: torch.Tensor, g: torch.Generator, std: float, mean: float = 0.0) -> None:
    with torch.no_grad():
        p.copy_(_normal(p.shape, g, std, mean).to(p.dtype))


def init_random_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter and buffer of a DeepseekV4Model in place (CPU generator, so the values
    do not depend on the device). Returns the model."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    hc = cfg.hc_mult
    state = model.state_dict(keep_vars=True)
    for name, p in sorted(state.items()):
        leaf = name.rsplit(".", 1)[-1]
        scale = state.get(name[:-len("weight")] + "scale") if leaf == "weight" else None
        if scale is not None:       # a quantized weight: bf16 values, then its format
            shape = native.logical_shape(p)
            value = _normal(shape, g, shape[-1] ** -0.5).to(torch.bfloat16)
            with torch.no_grad():
                native.copy_quantized(p, scale, value)
        elif leaf == "scale" and name[:-len("scale")] + "weight" in state:
            continue                # filled with its weight
        elif leaf == "tid2eid":
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
