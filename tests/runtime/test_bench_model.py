"""The decode benchmark's model (scripts/bench_model.py): tiled random weights, what bench_decode
builds a Flash-shaped slice with on a CPU, have the asked statistics and the seeded model's
tensors and formats."""

import pytest
import torch

import bench_runner  # noqa: F401 (puts scripts/ on sys.path)
from bench_model import TiledNormal, build_model

TINY = {"preset": "tiny", "layers": None, "experts": None, "vocab": None, "weights": None,
        "contexts": [16], "new_tokens": 4, "seed": 0}


def test_tiled_values_have_the_asked_spread_and_rows_that_differ():
    normal, g = TiledNormal(0), torch.Generator().manual_seed(1)
    small = normal((64, 256), g, 2.0, 1.0)               # fits the window: its rows end to end
    big = normal((16, 2048, 512), g, 512 ** -0.5)        # shifted rows
    for value, mean, std in ((small, 1.0, 2.0), (big, 0.0, 512 ** -0.5)):
        assert value.dtype == torch.bfloat16 and torch.isfinite(value).all()
        assert abs(value.float().mean().item() - mean) < 0.05 * std
        assert abs(value.float().std().item() / std - 1) < 0.05
    step = big.stride(1)                                 # (2^20 - 512) // (16 * 2048) = 31
    assert small.is_contiguous() and big.stride() == (2048 * step, step, 1) and step == 31
    assert not torch.equal(big[0, 0], big[0, 1])
    assert torch.equal(big[0, 0, step:], big[0, 1, :-step])
    again = TiledNormal(0)((64, 256), torch.Generator().manual_seed(1), 2.0, 1.0)
    assert torch.equal(again, small)                     # seeded
    with pytest.raises(ValueError, match="more rows than a pool"):
        normal((TiledNormal.POOL + 1, 4), g, 1.0)


def test_tiled_weights_keep_the_seeded_models_tensors_and_formats():
    """The small preset (native FP8/FP4 weights), cut to one layer."""
    spec = {**TINY, "preset": "small", "layers": 1}
    seeded, _ = build_model(spec)
    tiled, info = build_model({**spec, "init": "tiled"})
    assert info["init"] == "tiled" and info["weights"] == "native"
    assert "(tiled draws)" in info["note"]
    want = {k: (v.shape, v.dtype) for k, v in seeded.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in tiled.state_dict().items()} == want
    assert not torch.equal(tiled.embed.weight, seeded.embed.weight)
    with pytest.raises(ValueError, match="init must be one of"):
        build_model({**spec, "init": "zeros"})

