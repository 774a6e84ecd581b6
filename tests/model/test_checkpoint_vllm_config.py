"""A quantized checkpoint's config.json as vLLM 0.33 reads it: vLLM's per-architecture config hook
for the saved ``architectures`` routes it to vLLM's DeepSeek-V4 FP8 quantization method.

The checkpoint is saved in the pytest process (so a mutation run sees the saver); vLLM reads it in
a fresh interpreter (about 10 s): importing vLLM patches parts of torch and the environment, which
must not leak into the other tests. Skips where vLLM is not installed (the README's test command
installs it)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from dsv4.checkpoint import save_random_checkpoint
from dsv4.config import ModelConfig

READ_WITH_VLLM = """
import json, sys
from types import SimpleNamespace
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
from vllm.model_executor.models.config import MODELS_CONFIG_MAP

raw = json.loads(open(sys.argv[1]).read())
hf_config = SimpleNamespace(**raw)            # the attributes transformers' config would have
model_config = SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config)
MODELS_CONFIG_MAP[raw["architectures"][0]].verify_and_update_model_config(model_config)
method = hf_config.quantization_config["quant_method"]
print(json.dumps({"method": method, "known": method in QUANTIZATION_METHODS}))
"""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (requirements/vllm.txt)")
def test_a_quantized_hf_checkpoint_is_vllms_deepseek_v4_fp8(tmp_path):
    path = save_random_checkpoint(ModelConfig.preset("tiny"), tmp_path, 0, naming="hf")
    done = subprocess.run([sys.executable, "-c", READ_WITH_VLLM, str(path / "config.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert read == {"method": "deepseek_v4_fp8", "known": True}
