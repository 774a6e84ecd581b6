"""``write_checkpoint``: a model's state dict written as a checkpoint directory (config.json,
safetensors shards and their index), in the reference or the Hugging Face naming, in the published
formats (FP8 linears, FP4 routed experts: ``formats.stored_format``) unless asked for bf16
(``dsv4.checkpoint.save_random_checkpoint`` writes a seeded random model with it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import HF_ALIASES, HF_ROPE_SCALING
from . import quant
from .formats import FP4, FP8, stored_format
from .loader import INDEX_FILE
from .names import REF_SCALE, scale_name, to_hf

logger = logging.getLogger(__name__)

NAMINGS = ("reference", "hf")


def check_naming(naming: str) -> None:
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")


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
    d = config.to_dict()
    if naming == "hf":
        to_hf_key = {ref: hf for hf, ref in HF_ALIASES.items()}
        rope = {"type": "yarn"}
        rope.update({hf: d.pop(ref) for hf, ref in HF_ROPE_SCALING.items()})
        d = {to_hf_key.get(k, k): v for k, v in d.items()}
        d["rope_scaling"] = rope
        d["model_type"] = "deepseek_v4"
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        # The published config.json's head geometry, which engines read (MQA: K = V = the row).
        d.update(num_key_value_heads=1, v_head_dim=d["head_dim"],
                 qk_nope_head_dim=d["head_dim"] - d["qk_rope_head_dim"])
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


def write_checkpoint(state: dict[str, torch.Tensor], config, path, *, naming: str = "reference",
                     quantize: bool = True, shards: int = 2) -> list[Path]:
    """Write a model's state dict as a checkpoint directory ``path``: config.json and the
    safetensors shards (with their index when more than one). ``naming``, ``quantize``: as
    ``dsv4.checkpoint.save_random_checkpoint``. Returns the shard files."""
    check_naming(naming)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(state, naming, quantize)
    (path / "config.json").write_text(
        json.dumps(config_dict(config, naming, quantize), indent=2) + "\n")
    files = write_shards(tensors, path, shards)
    logger.info("wrote a checkpoint (%s naming%s): %d tensors in %d file(s) at %s",
                naming, ", quantized" if quantize else "", len(tensors), len(files), path)
    return files
