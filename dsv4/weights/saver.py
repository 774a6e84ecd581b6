"""``save_random_checkpoint``: a seeded random DeepseekV4Model written as a checkpoint directory
(config.json, safetensors shards and their index), in the reference or the Hugging Face naming,
in the published formats (FP8 linears, FP4 routed experts: ``formats.stored_format``) unless asked
for bf16.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import quant
from .formats import FP4, FP8, native_problem, stored_format
from .loader import INDEX_FILE
from .names import REF_SCALE, scale_name, to_hf

logger = logging.getLogger(__name__)

NAMINGS = ("reference", "hf")


def random_state_dict(config, seed: int, dtype: torch.dtype = torch.bfloat16,
                      weights: str = "bf16") -> dict[str, torch.Tensor]:
    """The state dict of ``DeepseekV4Model(config, dtype, weights=weights)`` after
    ``init_random_weights(seed)``."""
    from ..model import DeepseekV4Model
    from ..random_init import init_random_weights

    model = DeepseekV4Model(config, dtype=dtype, device="cpu", weights=weights)
    return init_random_weights(model, seed).state_dict()


def checkpoint_tensors(state: dict[str, torch.Tensor], naming: str, quantize: bool
                       ) -> dict[str, torch.Tensor]:
    """Model tensors -> stored tensors: renamed for ``naming``, quantized when asked. A weight
    the model already holds quantized (its ``.scale`` beside it) is written as it is."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("." + REF_SCALE):
            continue                                  # written beside its weight
        stored = name if naming == "reference" else to_hf(name)
        scale = state.get(name[: -len("weight")] + REF_SCALE) if name.endswith(".weight") else None
        fmt = stored_format(name) if quantize else None
        if scale is not None and not quantize:
            raise ValueError(f"quantize=False needs bf16 weights; {name} is held quantized")
        if scale is None and fmt == FP4:
            t, scale = quant.quant_fp4(t)
        elif scale is None and fmt == FP8:
            t, scale = quant.quant_fp8(t)
        out[stored] = t.contiguous()
        if scale is not None:
            out[scale_name(stored, naming)] = scale
    return out


def config_dict(config, naming: str, quantize: bool) -> dict:
    """config.json contents: reference field names, or the Hugging Face ones where they exist."""
    from ..config import HF_ALIASES, HF_ROPE_SCALING

    d = config.to_dict()
    if naming == "hf":
        to_hf_key = {ref: hf for hf, ref in HF_ALIASES.items()}
        rope = {"type": "yarn"}
        rope.update({hf: d.pop(ref) for hf, ref in HF_ROPE_SCALING.items()})
        d = {to_hf_key.get(k, k): v for k, v in d.items()}
        d["rope_scaling"] = rope
        d["model_type"] = "deepseek_v4"
        d["architectures"] = ["DeepseekV4ForCausalLM"]
    if quantize:
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "weight_block_size": list(quant.DEFAULT_FP8_BLOCK)}
    return d


def write_shards(tensors: dict[str, torch.Tensor], path: Path, shards: int) -> list[Path]:
    """Split the tensors (in order) over ``shards`` files; more than one file gets an index."""
    names = list(tensors)
    shards = max(1, min(shards, len(names)))
    if shards == 1:
        files = [(path / "model.safetensors", names)]
    else:
        per = -(-len(names) // shards)
        files = [(path / f"model-{i + 1:05d}-of-{shards:05d}.safetensors",
                  names[i * per:(i + 1) * per]) for i in range(shards)]
    for file, part in files:
        save_file({n: tensors[n] for n in part}, file, metadata={"format": "pt"})
    if shards > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: file.name for file, part in files for n in part}}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [file for file, _ in files]


def save_random_checkpoint(config, path, seed: int = 0, *, naming: str = "reference",
                           quantize: bool = True, dtype: torch.dtype = torch.bfloat16,
                           shards: int = 2) -> Path:
    """Write config.json and the safetensors of a random ``DeepseekV4Model(config, dtype)``
    (``dsv4.random_init.init_random_weights(seed)``) to the directory ``path``.

    ``naming``: "reference" (the published checkpoints' names, ``.scale`` scales) or "hf" (the
    Hugging Face variant, ``weight_scale_inv`` scales, HF config keys). ``quantize`` (default,
    as published): routed experts as int8-packed FP4 with 1x32 ue8m0 scales, the attention
    projections and the shared expert as FP8 e4m3 with 128x128 ue8m0 scales; False writes every
    weight in ``dtype``. Returns ``path``.
    """
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # A model holding the published formats hands over its stored bytes (no quantization round
    # trip); a config too narrow for 128-wide blocks is quantized from its bf16 weights.
    held = "native" if quantize and native_problem(config) is None else "bf16"
    tensors = checkpoint_tensors(random_state_dict(config, seed, dtype, held), naming, quantize)
    (path / "config.json").write_text(
        json.dumps(config_dict(config, naming, quantize), indent=2) + "\n")
    files = write_shards(tensors, path, shards)
    logger.info("wrote a random checkpoint (seed %d, %s naming%s): %d tensors in %d file(s) at %s",
                seed, naming, ", quantized" if quantize else "", len(tensors), len(files), path)
    return path
