"""Seeded random weights with scales that keep a DeepSeek-V4 stack numerically lively: unit-ish
activations, attention that is neither uniform nor one-hot, non-trivial routing and mixing.

Used for tests, benchmarks and the CLI's default model (no downloads). Deterministic for a seed.
A tensor-parallel rank's model (``DeepseekV4Model(split=...)``) gets its part of the whole
model's values of the same seed: every tensor is drawn whole, in the whole model's order, and
the rank keeps its slice (``dsv4.parallel.shards``).
A model holding the published formats (``weights="native"``) draws the same bf16 values and
quantizes them as the checkpoints are, so its FP8/FP4 weights are those of the bf16 model of the
same seed saved quantized (its bf16 ``wo_a`` is the bf16 model's; a checkpoint stores it FP8).
"""

from __future__ import annotations

import torch
from torch import nn

from .parallel import shards
from .weights import native


def _normal(shape, g: torch.Generator, std: float, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=g) * std + mean


def init_random_weights(model: nn.Module, seed: int = 0, normal=None) -> nn.Module:
    """Fill every parameter and buffer of a DeepseekV4Model in place (CPU generator, so the values
    do not depend on the device). Returns the model. ``normal(shape, g, std, mean)``: where the
    normal values come from (default: torch.randn draws; a benchmark may pass a cheaper source
    for a Flash-sized model, whose billion draws take minutes on a CPU)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    state = model.state_dict(keep_vars=True)
    split = model.split
    whole = model.whole_model_tensors()
    with torch.no_grad():
        for name, p in sorted(whole.items()):
            leaf = name.rsplit(".", 1)[-1]
            scale = whole.get(name[:-len("weight")] + "scale") if leaf == "weight" else None
            if leaf == "scale" and name[:-len("scale")] + "weight" in whole:
                continue                # filled with its weight
            value = _draw(name, leaf, p, scale is not None, cfg, g, normal or _normal)
            if name not in state:
                continue                # another rank's expert
            value = shards.take(split, name, value)
            if scale is not None:       # a quantized weight: bf16 values, then its format
                native.copy_quantized(state[name], state[name[:-len("weight")] + "scale"],
                                      value)
            else:
                state[name].copy_(value.to(state[name].dtype))
    return model


def _draw(name: str, leaf: str, p: torch.Tensor, quantized: bool, cfg,
          g: torch.Generator, normal) -> torch.Tensor:
    """The random value of the whole tensor ``name`` (``p``: the whole model's, for its shape)."""
    hc = cfg.hc_mult
    if quantized:
        shape = native.logical_shape(p)
        return normal(shape, g, shape[-1] ** -0.5).to(torch.bfloat16)
    if leaf == "tid2eid":
        return torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:p.shape[1]]
                            for _ in range(p.shape[0])])
    if name.endswith("norm.weight"):
        return normal(p.shape, g, 0.1, 1.0)
    if leaf == "attn_sink":
        return normal(p.shape, g, 1.0, 1.0)
    if leaf == "ape":
        return normal(p.shape, g, 0.5)
    if leaf == "bias":
        return normal(p.shape, g, 0.1)
    if "hc_" in leaf and leaf.endswith("_fn"):
        return normal(p.shape, g, p.shape[1] ** -0.5)
    if "hc_" in leaf and leaf.endswith("_scale"):
        return normal(p.shape, g, 0.1, 0.5)
    if "hc_" in leaf and leaf.endswith("_base"):
        value = normal(p.shape, g, 0.5).to(p.dtype)
        if p.numel() == (2 + hc) * hc:  # lean comb towards the identity (a residual stream)
            value[2 * hc:] += 2.0 * torch.eye(hc).flatten().to(p.dtype)
        return value
    if name == "embed.weight":
        return normal(p.shape, g, 1.0)
    if p.dim() == 2:
        return normal(p.shape, g, p.shape[1] ** -0.5)
    raise ValueError(f"init_random_weights: no rule for {name} {tuple(p.shape)}")
