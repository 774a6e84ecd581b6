"""Dispatcher ops of a decode layer (issue 26), counted as bench_decode counts them
(scripts/decode_launches.py --count dispatcher, over bench_common's counter): the whole decode
layer of the tiny preset at batch 1 and 8, and the mHC + norms + MoE part of a layer (tiny bf16
and small native). A dsv4 op is one dispatcher op whatever runs inside it, so these are not GPU
launches: test_gpu_launch_count.py counts those."""

from dataclasses import replace

import pytest
import torch

import bench_runner  # noqa: F401 (puts scripts/ on sys.path)
import bench_common as bc
import decode_launches
from dsv4.config import ModelConfig
from dsv4.layers import mhc
from dsv4.model import DeepseekV4Model
from dsv4.options import Options
from dsv4.random_init import init_random_weights
from tiny_model import tiny_model

LAYER_BOUND = 40        # issue 26: dispatcher ops per decode layer
MHC_MOE_OPS = 7         # hc_pre (+ attn_norm), hc_post, hc_pre (+ ffn_norm), 3 MoE ops, hc_post


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(max_seq_len=64, seed=0)


@pytest.mark.parametrize("batch", [1, 8])
def test_a_decode_layer_runs_at_most_40_dispatcher_ops(tiny, batch):
    """Every layer on its own, and the forward per layer (the step metadata, embedding, mHC
    head and logits around the layers included: issue 26's count)."""
    with torch.no_grad():
        found = decode_launches.decode_layer_ops(tiny, batch, 16)
    assert len(found["layer_ops"]) == tiny.config.n_layers
    assert sum(found["layer_ops"]) < found["forward_ops"] < found["step_ops"]
    assert found["layer_ops_max"] <= LAYER_BOUND, found
    assert found["forward_ops_per_layer"] <= LAYER_BOUND, found


def mhc_moe_ops(model, batch: int) -> list[int]:
    """Per layer: the ops of mHC pre + attn_norm, mHC post of the attention, and the FFN half
    (mHC pre + ffn_norm, MoE, mHC post), on random hidden copies."""
    cfg, options = model.config, Options()
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, cfg.hc_mult, cfg.dim, generator=g).bfloat16()
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
    counts = []
    with torch.no_grad():
        for layer in model.layers:
            _, post, comb = layer.attn_input(x, options)
            out = x[:, 0].contiguous()
            counts.append(sum(bc.count_dispatcher_ops(f).launches for f in (
                lambda: layer.attn_input(x, options),
                lambda: layer.ffn_block(x, ids, options),
                lambda: mhc.hc_post(out, x, post, comb))))
    return counts


@pytest.mark.parametrize("batch", [1, 8])
def test_mhc_norms_and_moe_are_seven_ops_a_layer(tiny, batch):
    assert mhc_moe_ops(tiny, batch) == [MHC_MOE_OPS] * tiny.config.n_layers


def test_the_native_small_model_too():
    cfg = ModelConfig.preset("small")
    cfg = replace(cfg, n_layers=2, compress_ratios=cfg.compress_ratios[:2], n_mtp_layers=0,
                  n_hash_layers=1)
    model = init_random_weights(DeepseekV4Model(cfg, max_seq_len=64), seed=0)
    assert model.weights == "native"
    for batch in (1, 8):
        assert mhc_moe_ops(model, batch) == [MHC_MOE_OPS] * 2      # a hash and a biased gate


def test_kv_bytes_follow_the_layers_rows():
    """tiny: one window row written per layer; a ratio-4 layer reads its top-k of the compressed
    rows and all its indexer rows, and writes one of each when the step completes a block."""
    cfg = ModelConfig.preset("tiny")
    row, index_row = 584, 132
    one = decode_launches.kv_bytes(cfg, 1, 64)
    window_reads = cfg.n_layers * min(64, cfg.window_size) * row
    assert one["kv_read_bytes"] > window_reads
    assert decode_launches.kv_bytes(cfg, 3, 64)["kv_read_bytes"] == 3 * one["kv_read_bytes"]
    off_block = decode_launches.kv_bytes(cfg, 1, 65)["kv_written_bytes"]
    ratio4 = sum(cfg.layer_ratio(i) == 4 for i in range(cfg.n_layers))
    ratio128 = sum(cfg.layer_ratio(i) == 128 for i in range(cfg.n_layers))
    assert off_block == cfg.n_layers * row
    assert decode_launches.kv_bytes(cfg, 1, 128)["kv_written_bytes"] == (
        off_block + ratio4 * (row + index_row) + ratio128 * row)
    assert decode_launches.floor_ms(2 * 10 ** 9, 10 ** 12) == 2.0
    assert decode_launches.floor_ms(10, None) is None
