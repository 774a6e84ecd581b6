"""Checkpoints as models: ``load_model`` builds a DeepseekV4Model from a checkpoint directory
(reference or Hugging Face naming, FP8/FP4 kept or dequantized), ``save_random_checkpoint`` writes
a seeded random one (for tests with no downloads). Reading and writing the tensors is
``dsv4.weights`` (``loader``, ``saver``); this module sits above it and above the model."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .model import DeepseekV4Model
from .options import Options
from .parallel import SINGLE, TensorSplit
from .random_init import init_random_weights
from .weights import loader, saver
from .weights.formats import native_problem
from .weights.loader import CheckpointError

__all__ = ["CheckpointError", "load_model", "save_random_checkpoint"]


def load_model(path, device="cpu", dtype: torch.dtype = torch.bfloat16, on_tensor=None,
               options: Options | None = None, weights: str | None = None,
               split: TensorSplit = SINGLE) -> DeepseekV4Model:
    """Build a DeepseekV4Model from ``path`` (config.json + safetensors) on ``device``.

    ``dtype`` is the model's compute dtype for its large weights; parameters the model keeps in
    float32 (norms, mHC, compressor, sinks, head) stay float32. ``weights``: the model's format
    (``DeepseekV4Model``). "native": quantized tensors keep their stored bytes and scales (FP8
    made fnuz exactly on an fnuz platform), bf16/fp32 ones are quantized as the checkpoints are,
    and an FP8 ``wo_a`` is dequantized (the reference computes it in bf16). "bf16": quantized
    weights are dequantized exactly (value times power-of-two scale) and rounded once to the
    parameter's dtype. None: "native" for a quantized checkpoint whose config allows it, else
    "bf16".
    ``on_tensor``, if given, is called after each tensor is loaded (progress reporting).
    ``options``: the model's ``dsv4.Options`` (None: read from the DSV4_* flags now); with
    ``options.check_weights`` every tensor is scanned for NaN/inf and tid2eid for experts out of
    range.
    ``split``: the tensor-parallel rank's part to build and read (``dsv4.parallel``): the
    checkpoint is checked against the whole model; the rank reads only its slices and experts.
    """
    options = Options.from_env() if options is None else options
    path = Path(path)
    raw_config = loader.read_config(path)
    config = ModelConfig.from_dict(raw_config, source=str(path / "config.json"))
    block = loader.fp8_block_size(raw_config)
    files = loader.checkpoint_files(path)
    stored = loader.read_headers(files)
    if weights is None:
        weights = ("native" if loader.stores_quantized(stored) and not native_problem(config)
                   else "bf16")
    model = DeepseekV4Model(config, dtype=dtype, device=device, options=options, weights=weights,
                            split=split)
    loader.fill_model(model, model.whole_model_tensors(), path, files, stored, block, options,
                      on_tensor)
    return model


def random_state_dict(config: ModelConfig, seed: int, dtype: torch.dtype = torch.bfloat16,
                      weights: str = "bf16") -> dict[str, torch.Tensor]:
    """The state dict of ``DeepseekV4Model(config, dtype, weights=weights)`` after
    ``init_random_weights(seed)``."""
    model = DeepseekV4Model(config, dtype=dtype, device="cpu", weights=weights)
    return init_random_weights(model, seed).state_dict()


def save_random_checkpoint(config: ModelConfig, path, seed: int = 0, *,
                           naming: str = "reference", quantize: bool = True,
                           dtype: torch.dtype = torch.bfloat16, shards: int = 2) -> Path:
    """Write config.json and the safetensors of a random ``DeepseekV4Model(config, dtype)``
    (``dsv4.random_init.init_random_weights(seed)``) to the directory ``path``.

    ``naming``: "reference" (the published checkpoints' names, ``.scale`` scales) or "hf" (the
    Hugging Face variant, ``weight_scale_inv`` scales, HF config keys). ``quantize`` (default,
    as published): routed experts as int8-packed FP4 with 1x32 ue8m0 scales, the attention
    projections and the shared expert as FP8 e4m3 with 128x128 ue8m0 scales; False writes every
    weight in ``dtype``. Returns ``path``.
    """
    saver.check_naming(naming)
    # A model holding the published formats hands over its stored bytes (no quantization round
    # trip); a config too narrow for 128-wide blocks is quantized from its bf16 weights.
    held = "native" if quantize and native_problem(config) is None else "bf16"
    saver.write_checkpoint(random_state_dict(config, seed, dtype, held), config, path,
                           naming=naming, quantize=quantize, shards=shards)
    return Path(path)
