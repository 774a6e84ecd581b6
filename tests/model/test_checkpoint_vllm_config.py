"""A quantized checkpoint's config.json as vLLM 0.33 reads it: vLLM's per-architecture config hook
for the saved ``architectures`` routes it to vLLM's DeepSeek-V4 FP8 quantization method.

In process (vLLM is imported here, about 10 s once): vLLM's import sets a few environment variables,
which the fixture puts back. Skips where vLLM is not installed (the README's test command
installs it)."""

import json
import os
from types import SimpleNamespace

import pytest

from dsv4.checkpoint import save_random_checkpoint
from dsv4.config import ModelConfig


@pytest.fixture(scope="module")
def vllm_readers():
    saved = dict(os.environ)
    try:
        pytest.importorskip("vllm", reason="vLLM is not installed (requirements/vllm.txt)")
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return MODELS_CONFIG_MAP, QUANTIZATION_METHODS


def test_a_quantized_hf_checkpoint_is_vllms_deepseek_v4_fp8(vllm_readers, tmp_path):
    models_config_map, quantization_methods = vllm_readers
    path = save_random_checkpoint(ModelConfig.preset("tiny"), tmp_path, 0, naming="hf")
    raw = json.loads((path / "config.json").read_text())
    hf_config = SimpleNamespace(**raw)            # the attributes transformers' config would have
    model_config = SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config)
    models_config_map[raw["architectures"][0]].verify_and_update_model_config(model_config)
    method = hf_config.quantization_config["quant_method"]
    assert method == "deepseek_v4_fp8"
    assert method in quantization_methods
