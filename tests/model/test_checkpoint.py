"""Checkpoints: save a random tiny model, load it back (both namings, quantized or not), and the
errors and notices of the loader. The dequantization here is an independent restatement of the
formats (bit-level e2m1 decode, index arithmetic for the block scales), not the library's."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv4
from dsv4.checkpoint import (CheckpointError, load_model, random_state_dict,
                             save_random_checkpoint)
from dsv4.config import ModelConfig
from dsv4.weights.names import to_hf, to_reference
from dsv4.weights.saver import checkpoint_tensors

ROOT = Path(__file__).resolve().parents[2]
SEED = 7


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def ref_state(cfg):
    return random_state_dict(cfg, SEED)


def stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def rewrite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the checkpoint's tensors by ``tensors``, in one file without an index."""
    for f in path.glob("*.safetensors"):
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, path / "model.safetensors")


def assert_same_state(model, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        assert got[name].dtype == want.dtype, name
        assert torch.equal(got[name], want), name


# ---- names ----------------------------------------------------------------------------------

def test_hf_names_round_trip_for_every_model_tensor(ref_state):
    hf = {to_hf(n) for n in ref_state}
    assert len(hf) == len(ref_state)
    for name in ref_state:
        assert to_reference(name) == (name, False)
        assert to_reference(to_hf(name)) == (name, False)


@pytest.mark.parametrize("stored, ref", [
    ("model.embed_tokens.weight", ("embed.weight", False)),
    ("lm_head.weight", ("head.weight", False)),
    ("model.hc_head.hc_fn", ("hc_head_fn", False)),
    ("model.layers.0.input_layernorm.weight", ("layers.0.attn_norm.weight", False)),
    ("model.layers.0.attn_hc.scale", ("layers.0.hc_attn_scale", False)),
    ("model.layers.0.self_attn.sinks", ("layers.0.attn.attn_sink", False)),
    ("model.layers.0.self_attn.q_a_norm.weight", ("layers.0.attn.q_norm.weight", False)),
    ("model.layers.1.self_attn.compressor.indexer.position_bias",
     ("layers.1.attn.indexer.compressor.ape", False)),
    ("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight",
     ("layers.1.attn.indexer.wq_b.weight", False)),
    ("model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
     ("layers.1.attn.indexer.weights_proj.weight", False)),
    ("model.layers.2.mlp.gate.e_score_correction_bias", ("layers.2.ffn.gate.bias", False)),
    ("model.layers.2.mlp.experts.3.down_proj.weight", ("layers.2.ffn.experts.3.w2.weight", False)),
    ("model.layers.0.self_attn.q_a_proj.weight_scale_inv", ("layers.0.attn.wq_a.weight", True)),
    ("model.layers.2.mlp.experts.3.up_proj.weight_scale", ("layers.2.ffn.experts.3.w3.weight", True)),
    ("layers.0.attn.wq_a.scale", ("layers.0.attn.wq_a.weight", True)),
    ("layers.0.hc_attn_scale", ("layers.0.hc_attn_scale", False)),
    ("hc_head_scale", ("hc_head_scale", False)),
])
def test_known_names(stored, ref):
    assert to_reference(stored) == ref


# ---- round trips ----------------------------------------------------------------------------

@pytest.mark.parametrize("naming, shards", [("reference", 2), ("hf", 1), ("reference", 3)])
def test_round_trip_gives_the_seeded_model(cfg, ref_state, tmp_path, naming, shards):
    path = save_random_checkpoint(cfg, tmp_path, SEED, naming=naming, shards=shards,
                                  quantize=False)
    names = set(stored_tensors(path))
    assert ("model.embed_tokens.weight" in names) == (naming == "hf")
    assert ("embed.weight" in names) == (naming == "reference")
    assert (path / "model.safetensors.index.json").exists() == (shards > 1)
    if shards > 1:
        assert_hugging_face_index(path)
    assert_same_state(load_model(path), ref_state)


def assert_hugging_face_index(path: Path) -> None:
    """The index of a sharded save has the layout Hugging Face tools read: each tensor's shard
    under "weight_map" and the tensors' byte count under "metadata"."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    shards = {f.name: load_file(f) for f in sorted(path.glob("*.safetensors"))}
    assert index["weight_map"] == {name: shard for shard, held in shards.items() for name in held}
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size()
                                                   for held in shards.values()
                                                   for t in held.values())}


def test_round_trip_detects_another_seed(cfg, ref_state, tmp_path):
    model = load_model(save_random_checkpoint(cfg, tmp_path, SEED + 1, quantize=False))
    with pytest.raises(AssertionError):
        assert_same_state(model, ref_state)


def test_loads_without_index_and_in_another_dtype(cfg, ref_state, tmp_path):
    path = save_random_checkpoint(cfg, tmp_path, SEED, shards=3, quantize=False)
    (path / "model.safetensors.index.json").unlink()
    model = load_model(path, dtype=torch.float32)
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float32
    assert_same_state(model, {k: v.float() if v.is_floating_point() else v
                              for k, v in ref_state.items()})


def test_config_from_hf_key_names(cfg, tmp_path):
    path = save_random_checkpoint(cfg, tmp_path, SEED, naming="hf")
    raw = json.loads((path / "config.json").read_text())
    assert {"hidden_size", "num_hidden_layers", "num_attention_heads", "rope_scaling"} <= set(raw)
    assert not {"dim", "n_layers", "n_heads", "rope_factor"} & set(raw)
    assert load_model(path).config == cfg


# ---- quantized ------------------------------------------------------------------------------

def e8m0(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, scale.view(torch.uint8).to(torch.float64) - 127)


def e2m1(code: torch.Tensor) -> torch.Tensor:
    """Bit-level decode: sign | 2 exponent bits | 1 mantissa bit, bias 1, subnormal at e = 0."""
    code = code.long()
    sign = 1 - 2 * ((code >> 3) & 1)
    e, m = (code >> 1) & 3, code & 1
    mag = torch.where(e == 0, 0.5 * m, torch.pow(2.0, e - 1) * (1 + 0.5 * m))
    return sign * mag


def independent_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(q.shape[0])[:, None] // 128
    cols = torch.arange(q.shape[1])[None, :] // 128
    return q.to(torch.float64) * e8m0(scale)[rows, cols]


def independent_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8)
    values = torch.empty(b.shape[0], b.shape[1] * 2, dtype=torch.float64)
    values[:, 0::2] = e2m1(b & 0x0F)
    values[:, 1::2] = e2m1(b >> 4)
    return values * e8m0(scale)[:, torch.arange(values.shape[1]) // 32]


def test_quantized_load_is_the_exact_dequantization(cfg, ref_state, tmp_path):
    path = save_random_checkpoint(cfg, tmp_path, SEED, quantize=True)
    stored = stored_tensors(path)
    expected, kinds = {}, {"fp8": 0, "fp4": 0}
    for name, ref in ref_state.items():
        scale = stored.get(name[: -len("weight")] + "scale")
        if scale is None:
            expected[name] = ref
            continue
        value = stored[name]
        kind = "fp8" if value.dtype == torch.float8_e4m3fn else "fp4"
        kinds[kind] += 1
        deq = (independent_fp8 if kind == "fp8" else independent_fp4)(value, scale)
        err = ((deq - ref.double()).norm() / ref.double().norm()).item()
        assert err < (0.05 if kind == "fp8" else 0.2), (name, err)  # a sane quantizer
        expected[name] = deq.to(ref.dtype)
    assert kinds["fp8"] >= cfg.n_layers * 5 and kinds["fp4"] == cfg.n_layers * 3 * 8
    assert_same_state(load_model(path), expected)


def test_published_formats_by_default_from_the_native_models_bytes(tmp_path):
    """By default the checkpoint holds FP8/FP4; a config that can compute natively hands over
    its model's stored bytes, the same bytes as quantizing its bf16 twin."""
    small = ModelConfig.preset("small")
    stored = stored_tensors(save_random_checkpoint(small, tmp_path, SEED))
    assert stored["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.0.attn.wo_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    twin = checkpoint_tensors(random_state_dict(small, SEED), "reference", quantize=True)
    assert stored.keys() == twin.keys()
    for name, t in twin.items():
        assert torch.equal(stored[name].view(torch.uint8) if t.element_size() == 1 else
                           stored[name], t.view(torch.uint8) if t.element_size() == 1 else t), name
    native = random_state_dict(small, SEED, weights="native")
    with pytest.raises(ValueError, match="quantize=False needs bf16 weights"):
        checkpoint_tensors(native, "reference", quantize=False)


def test_other_encodings_and_hf_naming_load_the_same_values(cfg, tmp_path):
    ref_path = save_random_checkpoint(cfg, tmp_path / "ref", SEED, quantize=True)
    baseline = load_model(ref_path).state_dict()
    # float4_e2m1fn_x2 packing, raw-byte ue8m0 expert scales, float32 FP8 block scales.
    tensors = stored_tensors(ref_path)
    for name, t in list(tensors.items()):
        if t.dtype == torch.int8 and ".experts." in name:
            tensors[name] = t.view(torch.uint8).view(torch.float4_e2m1fn_x2)
            tensors[name[: -len("weight")] + "scale"] = tensors[name[: -len("weight")] + "scale"
                                                               ].view(torch.uint8)
        elif t.dtype == torch.float8_e4m3fn:
            scale = name[: -len("weight")] + "scale"
            tensors[scale] = e8m0(tensors[scale]).float()
    rewrite(ref_path, tensors)
    assert_same_state(load_model(ref_path), baseline)
    hf_path = save_random_checkpoint(cfg, tmp_path / "hf", SEED, naming="hf", quantize=True)
    assert any(n.endswith(".weight_scale_inv") for n in stored_tensors(hf_path))
    assert_same_state(load_model(hf_path), baseline)


# ---- errors and notices ---------------------------------------------------------------------

def test_missing_unexpected_and_misshaped_tensors_in_one_error(cfg, tmp_path):
    path = save_random_checkpoint(cfg, tmp_path, SEED, quantize=False)
    tensors = stored_tensors(path)
    del tensors["layers.0.attn.wq_a.weight"]
    tensors["layers.0.attn.bogus.weight"] = torch.zeros(3, 5)
    tensors["layers.1.attn.wkv.weight"] = tensors["layers.1.attn.wkv.weight"][:, :-1].clone()
    rewrite(path, tensors)
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    msg = str(err.value)
    assert "1 missing, 1 unexpected, 1 mis-shaped" in msg
    assert f"layers.0.attn.wq_a.weight (expected shape [{cfg.q_lora_rank}, {cfg.dim}])" in msg
    assert "layers.0.attn.bogus.weight F32[3, 5]" in msg
    assert f"layers.1.attn.wkv.weight: expected shape [512, {cfg.dim}], got [512, {cfg.dim - 1}]" \
        in msg
    assert len(err.value.missing) == len(err.value.unexpected) == len(err.value.mismatched) == 1


def test_malformed_quantized_tensors_are_named(cfg, tmp_path):
    path = save_random_checkpoint(cfg, tmp_path, SEED, naming="hf", quantize=True)
    tensors = stored_tensors(path)
    del tensors["model.layers.0.self_attn.q_a_proj.weight_scale_inv"]
    scale = "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"
    tensors[scale] = tensors[scale][:, :1].clone()
    rewrite(path, tensors)
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    msg = str(err.value)
    assert "layers.0.attn.wq_a.weight (stored as model.layers.0.self_attn.q_a_proj.weight): " \
           "F8_E4M3 weight without a scale tensor" in msg
    assert f"scale {scale} expected shape [{cfg.moe_inter_dim}, {cfg.dim // 32}], got " \
           f"[{cfg.moe_inter_dim}, 1]" in msg
    assert len(err.value.mismatched) == 2


def test_a_tensor_stored_under_both_namings_is_an_error(cfg, tmp_path):
    """The duplicate is reported and the check goes on: a tensor read after it (norm.weight sorts
    after model.embed_tokens.weight) is still checked, so its wrong shape is named too and it is
    not mistaken for a missing tensor."""
    path = save_random_checkpoint(cfg, tmp_path, SEED)
    tensors = stored_tensors(path)
    tensors["model.embed_tokens.weight"] = tensors["embed.weight"].clone()
    tensors["norm.weight"] = tensors["norm.weight"][:-1].clone()
    rewrite(path, tensors)
    with pytest.raises(CheckpointError, match="embed.weight: stored twice, as ") as err:
        load_model(path)
    assert err.value.missing == [] and err.value.unexpected == []
    assert err.value.mismatched == [
        "embed.weight: stored twice, as embed.weight and model.embed_tokens.weight",
        f"norm.weight: expected shape [{cfg.dim}], got [{cfg.dim - 1}]"]


def test_mtp_tensors_are_skipped_with_a_notice(cfg, ref_state, tmp_path, caplog):
    path = save_random_checkpoint(cfg, tmp_path, SEED, quantize=False)
    tensors = stored_tensors(path)
    tensors["mtp.0.e_proj.weight"] = torch.zeros(cfg.dim, cfg.dim)
    tensors["mtp.0.attn.wq_a.weight"] = torch.zeros(cfg.q_lora_rank, cfg.dim)
    tensors["mtp.0.attn.wq_a.scale"] = torch.zeros(1, 1)
    # DeepSeek-V3-style Hugging Face checkpoints put the MTP layer after the last layer.
    tensors[f"model.layers.{cfg.n_layers}.self_attn.q_a_proj.weight"] = torch.zeros(1)
    rewrite(path, tensors)
    with caplog.at_level(logging.INFO, logger="dsv4.weights.loader"):
        model = load_model(path)
    assert_same_state(model, ref_state)
    notes = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(notes) == 1 and "skipping 4 MTP tensors" in notes[0]


def test_lazy_exports_keep_import_cheap():
    code = ("import sys, dsv4; assert 'dsv4.checkpoint' not in sys.modules; "
            "assert 'safetensors' not in sys.modules; "
            "from dsv4.checkpoint import load_model; assert dsv4.load_model is load_model")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert dsv4.save_random_checkpoint is save_random_checkpoint


@pytest.mark.parametrize("case", ["nan weight", "inf weight", "tid2eid out of range"])
def test_bad_values_are_refused_at_load_naming_tensor_and_file(cfg, tmp_path, flag_env, case):
    flag_env()
    save_random_checkpoint(cfg, tmp_path, seed=2, shards=1)
    tensors = stored_tensors(tmp_path)
    if case == "tid2eid out of range":
        name = next(n for n in tensors if n.endswith("tid2eid"))
        tensors[name].view(-1)[3] = cfg.n_routed_experts
        want = f"expert id {cfg.n_routed_experts} is outside 0..{cfg.n_routed_experts - 1}"
    else:
        name = next(n for n in tensors if n.endswith("attn_norm.weight"))
        tensors[name].view(-1)[5] = float("nan") if case == "nan weight" else float("inf")
        want = "1 NaN/inf values (first at index 5)"
    rewrite(tmp_path, tensors)
    with pytest.raises(ValueError) as e:
        load_model(tmp_path)
    assert name in str(e.value) and ".safetensors" in str(e.value) and want in str(e.value)
    if case != "tid2eid out of range":
        flag_env(DSV4_CHECK_WEIGHTS="0")   # the scan can be skipped
        model = load_model(tmp_path)
        assert not torch.isfinite(
            dict(model.named_parameters())[to_reference(name)[0]].view(-1)[5]).item()


def test_a_corrupt_config_names_its_file(cfg, tmp_path):
    save_random_checkpoint(cfg, tmp_path, seed=2, shards=1)
    (tmp_path / "config.json").write_text('{"dim": ')
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_model(tmp_path)
