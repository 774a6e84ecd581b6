"""The model a decode benchmark runs: a preset, optionally cut to fewer layers, routed experts and
vocabulary rows, with seeded random weights.

Weights (``init``): "seeded" draws every value with ``torch.randn`` (``dsv4.random_init``, the
values the tests and the CLI use); "tiled" takes them from one seeded pool (``TiledNormal``):
the same shapes, formats, per-tensor means and spreads, in seconds where a Flash-shaped slice's
billion draws take minutes on a CPU. Op counts and byte counts do not depend on the values.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

import bench_common as bc

INITS = ("seeded", "tiled")


class TiledNormal:
    """``normal(shape, g, std, mean)`` for ``init_random_weights``, at the cost of one copy into
    the parameter: one pool of ``POOL`` standard normal draws, and each tensor a strided view of
    a window of it (times std, plus mean, rounded to bf16) starting where ``g`` says. A tensor
    whose rows fit in ``WINDOW`` values end to end takes them so; a larger one's rows start
    ``step`` values apart (overlapping, shifted stretches of the window)."""

    POOL, WINDOW = 1 << 22, 1 << 20

    def __init__(self, seed: int):
        self.pool = torch.randn(self.POOL, generator=torch.Generator().manual_seed(seed))

    def __call__(self, shape, g: torch.Generator, std: float, mean: float = 0.0) -> torch.Tensor:
        shape = tuple(shape)
        k = shape[-1] if shape else 1
        rows = math.prod(shape[:-1])
        step = max(1, min(k, (self.WINDOW - k) // rows))
        span = (rows - 1) * step + k
        if span > self.POOL:
            raise ValueError(f"TiledNormal: shape {shape} has more rows than a pool of "
                             f"{self.POOL} values can start")
        start = int(torch.randint(self.POOL - span + 1, (), generator=g))
        window = (self.pool[start:start + span] * std + mean).to(torch.bfloat16)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = step if d == len(shape) - 2 else strides[d + 1] * shape[d + 1]
        return window.as_strided(shape, strides)


def add_model_args(p, preset: str, preset_help: str, layers_help: str) -> None:
    """The options that say which model a benchmark builds (`build_model`'s spec): --preset
    (default ``preset``), --layers, --experts, --vocab, --weights, --init."""
    p.add_argument("--preset", default=preset, help=preset_help)
    p.add_argument("--layers", type=int, default=None, help=layers_help)
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts per MoE layer (default: the preset's)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary rows (default: the preset's; a smaller one keeps a flash "
                        "slice's embedding and head small enough for a CPU)")
    p.add_argument("--weights", choices=("native", "bf16"), default=None,
                   help="weight format of the model (default: native where the config allows "
                        "it, else bf16)")
    p.add_argument("--init", choices=INITS, default="seeded",
                   help="random weights: seeded torch.randn draws (default), or tiled from one "
                        "seeded pool, same shapes and formats in seconds")


def build_model(spec: dict):
    """(model, info) for a benchmark spec: "preset", "layers", "experts", "vocab" (None: the
    preset's), "weights" (None: the default format), "contexts", "new_tokens" (the longest
    sequence), "seed", "init" (``INITS``; absent: seeded). info is the JSON's "model"."""
    from dsv4.config import ModelConfig
    from dsv4.model import DeepseekV4Model
    from dsv4.random_init import init_random_weights

    init = spec.get("init") or "seeded"
    if init not in INITS:
        raise ValueError(f"build_model: init must be one of {INITS}, got {init!r}")
    cfg = ModelConfig.preset(spec["preset"])
    full_layers, full_experts, full_vocab = cfg.n_layers, cfg.n_routed_experts, cfg.vocab_size
    layers = spec["layers"] or cfg.n_layers
    cfg = replace(cfg, n_layers=layers, compress_ratios=cfg.compress_ratios[:layers],
                  n_mtp_layers=0, n_hash_layers=min(cfg.n_hash_layers, layers),
                  n_routed_experts=spec["experts"] or cfg.n_routed_experts,
                  vocab_size=spec.get("vocab") or cfg.vocab_size)
    max_seq_len = max(spec["contexts"]) + spec["new_tokens"]
    model = DeepseekV4Model(cfg, device=bc.device(), max_seq_len=max_seq_len,
                            weights=spec["weights"])
    init_random_weights(model, spec["seed"],
                        TiledNormal(spec["seed"]) if init == "tiled" else None)
    reduced = (layers < full_layers or cfg.n_routed_experts < full_experts
               or cfg.vocab_size < full_vocab)
    values = "random weights" + (" (tiled draws)" if init == "tiled" else "")
    info = {"preset": spec["preset"], "n_layers": layers, "n_layers_full": full_layers,
            "reduced": reduced, "n_routed_experts": cfg.n_routed_experts,
            "n_routed_experts_full": full_experts, "vocab_size": cfg.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "weights": model.weights, "init": init,
            "note": (f"{spec['preset']} shapes cut to {layers}/{full_layers} layers and "
                     f"{cfg.n_routed_experts}/{full_experts} routed experts (top-"
                     f"{cfg.n_activated_experts} per token unchanged), vocabulary "
                     f"{cfg.vocab_size}/{full_vocab}, {values}")
            if reduced else f"{spec['preset']} preset, all layers, {values}"}
    return model, info
