"""A model holding the published weight formats (``weights="native"``): which tensors it holds
quantized, that a quantized checkpoint loads byte for byte (and about its own size), that a bf16
checkpoint or random weights are quantized as the checkpoints are, the fnuz conversion, and the
configs that cannot be native. The end-to-end numerics (the reference's FP8-mode logits bit for
bit) are in test_numerics_reference_fp8.py."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from dsv4 import Options
from dsv4.checkpoint import load_model, save_random_checkpoint
from dsv4.config import ModelConfig
from dsv4.layers.quant_linear import Fp8Linear
from dsv4.model import DeepseekV4Model
from dsv4.random_init import init_random_weights
from dsv4.weights import quant
from hip_kernels import fp8_linear
from reference_logits_fixtures import DATA, fixture_meta

SEED = 3


@pytest.fixture(scope="module")
def small():
    return ModelConfig.preset("small")


@pytest.fixture(scope="module")
def quantized_ckpt(small, tmp_path_factory):
    return save_random_checkpoint(small, tmp_path_factory.mktemp("q"), SEED, quantize=True)


def stored_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def test_the_small_preset_is_the_fp8_fixtures_config(small):
    """The tiny preset widened to 128-wide quantized inputs, in 4 output groups (2 and 4 ranks
    split it); the FP8 reference fixtures are made on it (make_fixture.py --mode fp8), so a
    change here needs them made again."""
    tiny = ModelConfig.preset("tiny")
    assert small == dataclasses.replace(tiny, dim=256, q_lora_rank=128, moe_inter_dim=128,
                                        o_groups=4, o_lora_rank=128)
    fixtures = sorted(DATA.glob("reference_logits_fp8_*.safetensors"))
    assert fixtures, "no tests/data/reference_logits_fp8_*.safetensors"
    for path in fixtures:
        assert ModelConfig.from_dict(json.loads(fixture_meta(path)["config"])) == small, path.name


def test_native_holds_the_published_formats_where_the_reference_computes_them(small):
    sd = DeepseekV4Model(small, device="meta", weights="native").state_dict()
    for name in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b",
                 "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3"):
        assert sd[f"layers.1.{name}.weight"].dtype == torch.float8_e4m3fn, name
        assert sd[f"layers.1.{name}.scale"].dtype == torch.float8_e8m0fnu, name
    assert sd["layers.1.attn.wq_b.scale"].shape == (2048 // 128, 128 // 128)
    assert sd["layers.1.ffn.experts.7.w2.weight"].shape == (256, 128 // 2)
    assert sd["layers.1.ffn.experts.7.w2.weight"].dtype == torch.int8
    assert sd["layers.1.ffn.experts.7.w2.scale"].shape == (256, 128 // 32)
    for name, dtype in (("layers.1.attn.wo_a.weight", torch.bfloat16),
                        ("layers.1.attn.indexer.weights_proj.weight", torch.bfloat16),
                        ("layers.1.ffn.gate.weight", torch.bfloat16),
                        ("layers.1.attn.compressor.wkv.weight", torch.float32),
                        ("head.weight", torch.float32), ("embed.weight", torch.bfloat16)):
        assert sd[name].dtype == dtype, name
        assert name[:-len("weight")] + "scale" not in sd, name


def test_default_format_follows_the_config(small):
    assert DeepseekV4Model(small, device="meta").weights == "native"
    assert DeepseekV4Model(small, device="meta", weights="bf16").weights == "bf16"
    tiny = ModelConfig.preset("tiny")
    assert DeepseekV4Model(tiny, device="meta").weights == "bf16"
    with pytest.raises(ValueError, match=r"dim=64.*q_lora_rank=32.*moe_inter_dim=32"):
        DeepseekV4Model(tiny, device="meta", weights="native")
    with pytest.raises(ValueError, match="weights must be one of"):
        DeepseekV4Model(small, device="meta", weights="fp8")
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16"):
        DeepseekV4Model(small, device="meta", weights="native", dtype=torch.float32)


def test_quantized_checkpoint_loads_its_bytes_exactly(quantized_ckpt):
    stored = stored_tensors(quantized_ckpt)
    model = load_model(quantized_ckpt, options=Options())
    assert model.weights == "native"
    got = model.state_dict()
    n_quantized = 0
    for name, t in got.items():
        if name.endswith("wo_a.weight"):    # FP8 in the checkpoint, bf16 in the model
            want = quant.dequant_fp8(stored[name], stored[name[:-len("weight")] + "scale"])
            assert torch.equal(t, want.to(torch.bfloat16)), name
            continue
        n_quantized += t.element_size() == 1
        assert t.dtype == stored[name].dtype or t.element_size() == 1, name
        assert torch.equal(as_bytes(t), as_bytes(stored[name]).to(t.device)), name
    assert n_quantized > 100
    param_bytes = sum(t.numel() * t.element_size() for t in got.values())
    stored_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    assert abs(param_bytes / stored_bytes - 1) < 0.15, (param_bytes, stored_bytes)


def test_bf16_checkpoint_and_random_weights_are_quantized_as_checkpoints_are(small, tmp_path,
                                                                           quantized_ckpt):
    from_quantized = load_model(quantized_ckpt, options=Options()).state_dict()
    bf16 = save_random_checkpoint(small, tmp_path, SEED, quantize=False)
    assert load_model(bf16, options=Options()).weights == "bf16"     # the stored values kept
    from_bf16 = load_model(bf16, options=Options(), weights="native").state_dict()
    random = init_random_weights(DeepseekV4Model(small, weights="native"), SEED).state_dict()
    for name, t in from_quantized.items():
        if name.endswith("wo_a.weight"):
            continue            # bf16 here; the quantized checkpoint's is dequantized FP8
        assert torch.equal(as_bytes(from_bf16[name]), as_bytes(t)), name
        assert torch.equal(as_bytes(random[name]), as_bytes(t)), name


def test_bf16_model_of_a_quantized_checkpoint_is_the_dequantized_one(quantized_ckpt):
    model = load_model(quantized_ckpt, options=Options(), weights="bf16")
    stored = stored_tensors(quantized_ckpt)
    w = model.state_dict()["layers.0.attn.wq_a.weight"]
    assert w.dtype == torch.bfloat16
    want = quant.dequant_fp8(stored["layers.0.attn.wq_a.weight"],
                             stored["layers.0.attn.wq_a.scale"])
    assert torch.equal(w, want.to(torch.bfloat16))


def test_fnuz_platform_holds_fnuz_weights_with_the_same_outputs(flag_env, quantized_ckpt):
    """On an fnuz platform the FP8 weights are the same bytes read as e4m3fnuz (0x80 -> 0x00) with
    the scales doubled; the linear's outputs are the OCP ones bit for bit."""
    ocp = load_model(quantized_ckpt, options=Options())
    flag_env(DSV4_FP8_DIALECT="fnuz")
    fnuz = load_model(quantized_ckpt, options=Options())
    a, b = ocp.layers[0].attn.wq_b, fnuz.layers[0].attn.wq_b
    assert b.weight.dtype == torch.float8_e4m3fnuz
    ocp_bytes = a.weight.view(torch.uint8)
    assert torch.equal(b.weight.view(torch.uint8),
                       torch.where(ocp_bytes == 0x80, torch.zeros_like(ocp_bytes), ocp_bytes))
    assert torch.equal(b.scale.view(torch.uint8), a.scale.view(torch.uint8) + 1)
    x = torch.randn(5, a.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(b(x), a(x))


def test_fp8_linear_module_is_one_fp8_linear_op(quantized_ckpt):
    lin = load_model(quantized_ckpt, options=Options()).layers[1].attn.wkv
    assert isinstance(lin, Fp8Linear)
    x = torch.randn(2, 3, lin.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = fp8_linear(x.flatten(0, 1), lin.weight, lin.scale).view(2, 3, -1)
    assert torch.equal(lin(x), want)


def test_captured_decode_of_a_native_model_equals_eager(small):
    """The routed experts' grouped FP4 op inside a (CPU-emulated) graph: no host read of the
    group offsets, the eager bits."""
    from dsv4.engine import Engine

    model = init_random_weights(DeepseekV4Model(small, options=Options()), SEED)
    out = []
    for graph in (False, True):
        engine = Engine(model, max_batch=2, max_context_len=256, page_size=128, graph=graph,
                        options=Options())
        out.append(engine.generate([[5, 6, 7, 8], [9, 10, 11]], 4, return_logits=True))
    assert out[0].tokens == out[1].tokens
    assert torch.equal(out[0].logits, out[1].logits)


def test_other_encodings_and_hf_naming_load_the_same_bytes(small, tmp_path, quantized_ckpt):
    """float4_e2m1fn_x2 experts with raw-byte scales, float32 (power-of-two) FP8 scales, and the
    Hugging Face naming give the native model the same bytes."""
    from safetensors.torch import save_file

    baseline = load_model(quantized_ckpt, options=Options()).state_dict()
    tensors = stored_tensors(quantized_ckpt)
    for name, t in list(tensors.items()):
        scale = name[:-len("weight")] + "scale"
        if t.dtype == torch.int8:
            tensors[name] = t.view(torch.float4_e2m1fn_x2)
            tensors[scale] = tensors[scale].view(torch.uint8)
        elif t.dtype == torch.float8_e4m3fn:
            tensors[scale] = tensors[scale].float()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((quantized_ckpt / "config.json").read_text())
    save_file(tensors, other / "model.safetensors")
    hf = save_random_checkpoint(small, tmp_path / "hf", SEED, naming="hf", quantize=True)
    for path in (other, hf):
        got = load_model(path, options=Options(), weights="native").state_dict()
        for name, t in baseline.items():
            assert torch.equal(as_bytes(got[name]), as_bytes(t)), (path.name, name)


def test_scales_that_are_not_powers_of_two_are_refused_naming_the_tensor(tmp_path,
                                                                         quantized_ckpt):
    from safetensors.torch import save_file

    tensors = stored_tensors(quantized_ckpt)
    tensors["layers.0.attn.wkv.scale"] = tensors["layers.0.attn.wkv.scale"].float() * 1.5
    (tmp_path / "config.json").write_text((quantized_ckpt / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wkv\.weight.*weights='bf16'"):
        load_model(tmp_path, options=Options(), weights="native")
    load_model(tmp_path, options=Options(), weights="bf16")      # dequantized: fine


def test_state_dict_round_trip_of_a_native_model(small):
    """Per-expert ``{e}.w1.weight`` / ``{e}.w1.scale`` entries gather back into the stacked
    packed weights and scales."""
    a = init_random_weights(DeepseekV4Model(small, weights="native"), SEED)
    b = DeepseekV4Model(small, weights="native")
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.layers[2].ffn.experts.w2_scale.view(torch.uint8),
                       a.layers[2].ffn.experts.w2_scale.view(torch.uint8))
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(as_bytes(x), as_bytes(y)), name
