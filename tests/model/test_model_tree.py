"""The module tree reproduces the reference checkpoint's tensor names and shapes."""

import dataclasses
import re
from collections import Counter

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model import DeepseekV4Model

# Published DeepSeek-V4-Flash shapes (safetensors header of the released checkpoint).
FLASH_SHAPES = {
    "layers.0.attn.attn_sink": (64,),
    "layers.0.attn.q_norm.weight": (1024,),
    "layers.0.attn.kv_norm.weight": (512,),
    "layers.0.attn.wq_a.weight": (1024, 4096),
    "layers.0.attn.wq_b.weight": (32768, 1024),
    "layers.0.attn.wkv.weight": (512, 4096),
    "layers.0.attn.wo_a.weight": (8192, 4096),
    "layers.0.attn.wo_b.weight": (4096, 8192),
    "layers.0.ffn.gate.weight": (256, 4096),
    "layers.0.ffn.gate.tid2eid": (129280, 6),
    "layers.0.hc_attn_scale": (3,),
    "layers.0.hc_attn_base": (24,),
    "layers.0.hc_attn_fn": (24, 16384),
    "layers.0.ffn.experts.0.w1.weight": (2048, 4096),
    "layers.0.ffn.shared_experts.w1.weight": (2048, 4096),
    "layers.2.attn.compressor.ape": (4, 1024),
    "layers.2.attn.compressor.wkv.weight": (1024, 4096),
    "layers.2.attn.indexer.wq_b.weight": (8192, 1024),
    "layers.2.attn.indexer.weights_proj.weight": (64, 4096),
    "layers.2.attn.indexer.compressor.ape": (4, 256),
    "layers.2.attn.indexer.compressor.norm.weight": (128,),
    "layers.3.attn.compressor.ape": (128, 512),
    "layers.3.attn.compressor.wgate.weight": (512, 4096),
    "layers.3.ffn.gate.bias": (256,),
    "hc_head_fn": (4, 16384),
    "hc_head_base": (4,),
    "hc_head_scale": (1,),
    "embed.weight": (129280, 4096),
    "head.weight": (129280, 4096),
    "norm.weight": (4096,),
}


@pytest.fixture(scope="module")
def flash_cut():
    """Flash-shaped layers 0..4 (ratios 0, 0, 4, 128, 4; layers 0-2 hash-routed), on meta; bf16
    weights, so every linear has its logical [out, in] shape (test_model_native_weights.py has
    the published formats' shapes)."""
    cfg = ModelConfig.preset("flash")
    cfg = dataclasses.replace(cfg, n_layers=5, compress_ratios=cfg.compress_ratios[:5])
    return DeepseekV4Model(cfg, device="meta", weights="bf16").state_dict()


def test_published_flash_shapes(flash_cut):
    for name, shape in FLASH_SHAPES.items():
        assert name in flash_cut, name
        assert tuple(flash_cut[name].shape) == shape, name


def test_tensor_families_per_layer_kind(flash_cut):
    families = Counter(re.sub(r"\.\d+\.", ".N.", k) for k in flash_cut)
    assert families["layers.N.attn.compressor.wkv.weight"] == 3       # ratio 4, 128, 4
    assert families["layers.N.attn.indexer.wq_b.weight"] == 2         # ratio 4 only
    assert families["layers.N.attn.indexer.compressor.ape"] == 2
    assert families["layers.N.ffn.gate.tid2eid"] == 3                 # the hash layers 0-2
    assert families["layers.N.ffn.gate.bias"] == 2
    assert families["layers.N.ffn.experts.N.w1.weight"] == 5 * 256
    names = set(flash_cut)
    assert "layers.1.attn.compressor.ape" not in names
    assert "layers.3.attn.indexer.wq_b.weight" not in names
    # reference dtypes: mHC, sink, ape, norms and compressor projections in fp32
    assert flash_cut["layers.3.attn.compressor.wkv.weight"].dtype == torch.float32
    assert flash_cut["layers.0.hc_attn_fn"].dtype == torch.float32
    assert flash_cut["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert flash_cut["layers.0.ffn.gate.tid2eid"].dtype == torch.int64


@pytest.mark.parametrize("weights", ["bf16", "native"])
def test_every_tensor_is_built_on_the_device_asked_for(weights):
    """A model built on a device holds every parameter and buffer there (the memory estimate and
    the tensor-parallel shard plan build on meta, a run on its GPU): native adds the FP8
    linears' and the FP4 experts' scales; a tensor left on the default device would be copied
    each step or counted nowhere."""
    model = DeepseekV4Model(ModelConfig.preset("small"), device="meta", weights=weights)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    assert "hc_head_base" in dict(tensors) and "freqs_cis" in dict(tensors)
    off = [name for name, t in tensors if t.device.type != "meta"]
    assert off == [], off
