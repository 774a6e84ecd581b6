"""A checkpoint whose FP8 projections carry one scale per 32x64 tile (config
weight_block_size [32, 64], not the default 128x128) loads as exactly those tiles' values."""

import json

import torch
from safetensors.torch import load_file, save_file

from dsv4.checkpoint import load_model, save_random_checkpoint
from dsv4.config import ModelConfig
from dsv4.weights import quant

TINY = ModelConfig.preset("tiny")

BLOCK = (32, 64)                  # not the default (128, 128), and not square
FP8_NAMES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
             "attn.wo_b.weight")


def dequant_blocks(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float64 value of an FP8 weight with one ue8m0 scale per block[0] x block[1] tile, by
    index arithmetic."""
    rows = torch.arange(q.shape[0])[:, None] // block[0]
    cols = torch.arange(q.shape[1])[None, :] // block[1]
    exp = scale.view(torch.uint8).to(torch.float64) - 127
    return q.to(torch.float64) * torch.pow(2.0, exp)[rows, cols]


def test_a_checkpoint_with_another_fp8_block_size_loads_its_exact_dequantization(tmp_path):
    """A checkpoint whose config says weight_block_size [32, 64]: its FP8 projections carry one
    scale per 32x64 tile. The loaded model holds exactly those tiles' dequantization (and every
    other tensor as saved); a loader that assumes 128x128 tiles refuses the scale shapes or
    scales whole 128x128 areas by one tile's scale."""
    path = save_random_checkpoint(TINY, tmp_path, seed=7, shards=1, quantize=False)
    tensors = load_file(path / "model.safetensors")
    expected, differs_from_default = dict(tensors), False
    for name in list(tensors):
        if not name.endswith(FP8_NAMES):
            continue
        w = tensors[name]
        q, scale = quant.quant_fp8(w, BLOCK)
        assert scale.shape == (-(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1]))
        tensors[name], tensors[name[:-len("weight")] + "scale"] = q, scale
        deq = dequant_blocks(q, scale, BLOCK)
        assert ((deq - w.double()).norm() / w.double().norm()) < 0.05      # a sane encoding
        expected[name] = deq.to(w.dtype)
        # Tiles of one 128x128 area have different scales: the block size matters here.
        differs_from_default |= bool((scale[:4, :2] != scale[0, 0]).any())
    assert differs_from_default
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": list(BLOCK)}
    (path / "config.json").write_text(json.dumps(config))
    state = load_model(path).state_dict()
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        assert torch.equal(state[name], want), name
