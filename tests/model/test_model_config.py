"""ModelConfig: reference and Hugging Face names, presets, validation that names the field."""

import json
import logging

import pytest

from dsv4.config import ModelConfig

# The published DeepSeek-V4-Flash config.json (Hugging Face names), abridged of nothing that
# matters to the math.
HF_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "bos_token_id": 0,
    "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4", "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
    "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_hf_flash_config_equals_flash_preset(caplog):
    with caplog.at_level(logging.WARNING, logger="dsv4.config"):
        cfg = ModelConfig.from_dict(HF_FLASH)
    assert cfg == ModelConfig.preset("flash")
    assert "unknown" not in caplog.text  # every published key is known


def test_reference_names_roundtrip_and_extra_keys(tmp_path, caplog):
    d = ModelConfig.preset("pro").to_dict()
    d.update(max_batch_size=4, dtype="fp8", scale_fmt="ue8m0", max_seq_len=4096)
    d["some_future_key"] = 1
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with caplog.at_level(logging.WARNING, logger="dsv4.config"):
        cfg = ModelConfig.from_json(tmp_path)
    assert cfg == ModelConfig.preset("pro")
    assert "some_future_key" in caplog.text and "max_batch_size" not in caplog.text


def test_presets_have_the_published_shapes():
    flash, pro, tiny = (ModelConfig.preset(n) for n in ("flash", "pro", "tiny"))
    assert (flash.dim, flash.n_layers, flash.n_heads, flash.n_routed_experts) == (4096, 43, 64, 256)
    assert (pro.dim, pro.n_layers, pro.n_heads, pro.n_routed_experts) == (7168, 61, 128, 384)
    assert len(flash.compress_ratios) == 44 and flash.compress_ratios[:4] == (0, 0, 4, 128)
    assert flash.compress_ratios[42:] == (4, 0)
    assert len(pro.compress_ratios) == 62 and pro.compress_ratios[:4] == (128, 128, 4, 128)
    assert (pro.index_topk, pro.route_scale, pro.o_groups) == (1024, 2.5, 16)
    # tiny: every layer kind, hash and score routing, selection at test lengths
    assert set(tiny.compress_ratios) == {0, 4, 128} and tiny.window_size == 128
    assert 0 < tiny.n_hash_layers < tiny.n_layers
    assert (tiny.head_dim, tiny.rope_head_dim, tiny.index_head_dim) == (512, 64, 128)
    assert tiny.index_topk < 300 // 4


@pytest.mark.parametrize("change, field", [
    (dict(compress_ratios=(0, 4, 128)), "compress_ratios"),
    (dict(compress_ratios=(0, 4, 128, 8)), "compress_ratios"),
    (dict(n_heads=5), "o_groups"),
    (dict(head_dim=256), "head_dim"),
    (dict(rope_head_dim=32), "rope_head_dim"),
    (dict(n_activated_experts=9), "n_activated_experts"),
    (dict(n_hash_layers=5), "n_hash_layers"),
    (dict(score_func="relu"), "score_func"),
    (dict(dim=0), "dim"),
])
def test_inconsistent_config_names_the_field(change, field):
    d = ModelConfig.preset("tiny").to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        ModelConfig.from_dict(d)


COUNTS = ("vocab_size", "dim", "n_layers", "n_heads", "q_lora_rank", "o_groups", "o_lora_rank",
          "window_size", "index_n_heads", "index_topk", "hc_mult", "hc_sinkhorn_iters",
          "n_routed_experts", "n_activated_experts", "moe_inter_dim")


@pytest.mark.parametrize("field", COUNTS)
def test_every_count_takes_one_and_refuses_zero(field):
    """1 is a legal count (one group, one expert routed, one Sinkhorn iteration, ...); 0 and
    non-integers are refused naming the field."""
    d = ModelConfig.preset("tiny").to_dict()
    one = {**d, field: 1}
    if field == "n_layers":
        one.update(compress_ratios=d["compress_ratios"][:1], n_hash_layers=0)
    if field == "n_routed_experts":
        one.update(n_activated_experts=1)
    if field == "n_heads":
        one.update(o_groups=1)
    assert getattr(ModelConfig.from_dict(one), field) == 1
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match=rf"ModelConfig\.{field}: must be a positive integer"):
            ModelConfig.from_dict({**one, field: bad})


def test_conflicting_aliases_and_bad_kv_heads_raise():
    d = ModelConfig.preset("tiny").to_dict()
    with pytest.raises(ValueError, match="dim"):
        ModelConfig.from_dict({**d, "hidden_size": d["dim"] + 1})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_dict({**d, "num_key_value_heads": 8})
    with pytest.raises(ValueError, match="preset"):
        ModelConfig.preset("huge")


def test_compress_ratios_may_include_mtp_layers():
    d = ModelConfig.preset("tiny").to_dict()
    cfg = ModelConfig.from_dict({**d, "n_mtp_layers": 1, "compress_ratios": [0, 4, 128, 4, 0]})
    assert cfg.layer_ratio(4) == 0 and cfg.n_layers == 4


@pytest.mark.parametrize("raw", [{"foo": 1}, {}, {"architectures": ["DeepseekV4ForCausalLM"]}])
def test_a_config_without_model_keys_is_refused_naming_the_file(tmp_path, raw):
    """Not silently the Flash defaults: the file and the keys it should hold are named."""
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: no DeepSeek-V4 model key "
                                         r"in it \(expected keys such as dim or hidden_size"):
        ModelConfig.from_json(tmp_path)


def test_a_config_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object of model keys, "
                                         "got list"):
        ModelConfig.from_json(tmp_path)


def test_one_known_key_is_enough_and_unknown_keys_name_the_source(caplog):
    with caplog.at_level(logging.WARNING, logger="dsv4.config"):
        cfg = ModelConfig.from_dict({"hidden_size": 4096, "foo": 1}, source="x/config.json")
    assert cfg.dim == 4096
    assert "x/config.json: ignoring unknown config keys: foo" in caplog.text
