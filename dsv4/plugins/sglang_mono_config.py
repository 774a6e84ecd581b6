"""SGLang's hf_config read as this project's ModelConfig (for the monokernel's checks, load hook
and build)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import HF_ALIASES, ROPE_SCALING_KEYS, ModelConfig


def hf_dict(hf_config: Any) -> dict:
    """The Hugging Face config as a plain dict (a PretrainedConfig or already a dict)."""
    return dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()


def model_config(hf_config: Any) -> ModelConfig:
    """This project's ModelConfig of SGLang's hf_config (a ValueError names a bad field). Only
    the model's own keys are read: a transformers config also carries generic ones."""
    known = {f.name for f in dataclasses.fields(ModelConfig)} | set(HF_ALIASES) | {
        *ROPE_SCALING_KEYS, "num_key_value_heads", "qk_nope_head_dim", "v_head_dim"}
    d = {k: v for k, v in hf_dict(hf_config).items() if k in known}
    return ModelConfig.from_dict(d, source="hf_config")
