"""The monokernel spec against the real SGLang 0.5.23: its registry and its startup validation.

SGLang's own functions decide here: `find_spec` (the registry the entry point fills), and
`monokernel_disable_reasons` (what `handle_amd_monokernel` runs while resolving the server
arguments) over real `ServerArgs` of a Hugging Face-named checkpoint of the small preset. The
one stand-in is the ISA, which SGLang reads from a GPU (`isa=` below).
"""

import logging

import pytest

from sglang_host import tp_ranks, use_stubs

use_stubs()
spec_api = pytest.importorskip("sglang.kernels.plugin_kernels.amd.spec",
                               reason="SGLang 0.5.23 is not installed (see README)")

from dsv4.checkpoint import save_random_checkpoint  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.plugins import sglang as plugin  # noqa: E402
from dsv4.plugins import sglang_monokernel as mono  # noqa: E402
from dsv4.plugins.sglang_mono_checks import config_disable_reasons  # noqa: E402

ARCH = ["DeepseekV4ForCausalLM"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The small preset (FP8/FP4, the published formats) with Hugging Face names and config."""
    path = tmp_path_factory.mktemp("small_hf")
    return save_random_checkpoint(ModelConfig.preset("small"), path, naming="hf", seed=3)


@pytest.fixture
def registry(monkeypatch):
    """SGLang's spec registry, empty for this test."""
    monkeypatch.setattr(spec_api, "_REGISTRY", {})
    return spec_api._REGISTRY


def server_args(checkpoint, **overrides):
    from sglang.srt.server_args import ServerArgs

    args = dict(model_path=str(checkpoint), device="cpu", tp_size=1, dtype="bfloat16",
                enable_amd_monokernel=True, attention_backend="dsv4",
                kv_cache_dtype="fp8_e4m3")
    return ServerArgs(**{**args, **overrides})


def reasons(checkpoint, isa="gfx942", **overrides):
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view
    from sglang.srt.kernel_plugins.amd.binding import monokernel_disable_reasons

    sa = server_args(checkpoint, **overrides)
    spec, why = monokernel_disable_reasons(cfg=resolving_view(sa), model_config=model_config_of(sa),
                                           isa=isa)
    return spec, why


def test_the_entry_point_registers_the_spec_sglang_finds(registry, flag_env):
    flag_env()
    plugin._register_monokernel()
    spec, why = spec_api.find_spec(backend="amd", architectures=ARCH, isa="gfx942")
    assert why == "" and spec is mono.SPEC
    assert registry == {"amd": {"DeepseekV4ForCausalLM": "dsv4.plugins.sglang_monokernel:SPEC"}}
    for isa in ("gfx942", "gfx950"):
        assert spec.widths(isa) == tuple(range(1, 65))
        assert spec.devices[isa].tp_sizes == (1, 2, 4, 8)
    _, why = spec_api.find_spec(backend="amd", architectures=ARCH, isa="sm_90")
    assert why == "monokernel backend 'amd' has no spec for ['DeepseekV4ForCausalLM'] on sm_90"


@pytest.mark.parametrize("env", [{"DSV4_SGLANG_MONOKERNEL": "0"}, {"DSV4_SGLANG_PLUGIN": "0"}])
def test_the_flags_leave_the_spec_unregistered(registry, flag_env, env, caplog):
    flag_env(**env)
    with caplog.at_level(logging.INFO, logger="dsv4"):
        plugin.register()
    assert registry == {}
    _, why = spec_api.find_spec(backend="amd", architectures=ARCH, isa="gfx942")
    assert why.startswith("no monokernel backend 'amd' is registered")
    assert list(env)[0] in caplog.text


def test_another_monokernel_api_version_is_one_line_and_sglang_keeps_its_path(
        registry, flag_env, monkeypatch, caplog):
    flag_env()
    monkeypatch.setattr(spec_api, "MONOKERNEL_API_VERSION", 2)
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        plugin._register_monokernel()
    assert registry == {}
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dsv4")]
    assert lines == ["dsv4-rocm: monokernel spec not registered: SGLang's monokernel API is "
                     "version 2, this spec is written for version 1"]


def test_a_sglang_without_the_contract_is_one_line(registry, flag_env, monkeypatch, caplog):
    import builtins

    flag_env()
    real_import = builtins.__import__

    def no_contract(name, *args, **kwargs):
        if name.startswith("sglang.kernels.plugin_kernels"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_contract)
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        plugin._register_monokernel()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dsv4")]
    assert len(lines) == 1 and "monokernel spec not registered" in lines[0]
    assert "no usable AMD monokernel contract" in lines[0]


def test_a_contract_whose_types_changed_is_one_line(registry, flag_env, monkeypatch, caplog):
    """The same API version, but its MonoSpec no longer takes this spec's fields."""
    import types

    def changed_spec(**fields):
        raise TypeError("MonoSpec.__init__() got an unexpected keyword argument 'devices'")

    flag_env()
    changed = types.SimpleNamespace(**{k: getattr(spec_api, k) for k in dir(spec_api)
                                       if not k.startswith("_")})
    changed.MonoSpec = changed_spec
    monkeypatch.setattr(mono, "contract", lambda: changed)
    mono.make_spec.cache_clear()
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        plugin._register_monokernel()
    mono.make_spec.cache_clear()
    assert registry == {}
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dsv4")]
    assert len(lines) == 1 and lines[0].startswith("dsv4-rocm: monokernel spec not registered: ")
    assert lines[0].endswith("monokernel contract does not take this spec (TypeError: "
                             "MonoSpec.__init__() got an unexpected keyword argument 'devices')")


def test_importing_the_spec_module_imports_no_sglang():
    """SGLang's contract is imported when the spec is first made, not with the module."""
    import subprocess
    import sys

    code = ("import sys; import dsv4.plugins.sglang_monokernel; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.strip() == "[]"


def test_a_broken_spec_module_is_a_reason_not_a_crash(registry):
    """SGLang imports the spec lazily; a spec path that does not import is listed as a reason."""
    spec_api.register(backend="amd", architecture=ARCH[0], path="dsv4.plugins.no_such:SPEC")
    spec, why = spec_api.find_spec(backend="amd", architectures=ARCH, isa="gfx942")
    assert spec is None and why.startswith("dsv4.plugins.no_such:SPEC does not import")


@pytest.mark.parametrize("isa", ["gfx942", "gfx950"])
def test_a_supported_server_has_no_reason(registry, checkpoint, isa):
    mono.register_spec()
    spec, why = reasons(checkpoint, isa=isa)
    assert spec is mono.SPEC and why == []


@pytest.mark.parametrize("overrides, reason", [
    (dict(enable_dp_attention=True, dp_size=2, tp_size=2),
     "DP attention is in use and the spec does not accept it"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="CKPT"),
     "speculative decoding is in use and the spec does not accept it"),
    (dict(ep_size=2, tp_size=2), "expert parallelism is in use and the spec does not accept it"),
    (dict(tp_size=3), "tp_size 3 is not one of ['1', '2', '4', '8']"),
    (dict(enable_deterministic_inference=True),
     "--enable-deterministic-inference needs a BITWISE spec, and this one is not"),
    (dict(kv_cache_dtype="bfloat16"), "kv_cache_dtype 'bfloat16' is not one of ['fp8_e4m3']"),
    (dict(enable_deepseek_v4_fp4_indexer=True),
     "enable_deepseek_v4_fp4_indexer True is not one of ['False']"),
    (dict(page_size=64), "--page-size 64 is not a multiple of 128 (a page must hold whole C128 "
                         "rows)"),
])
def test_sglang_names_what_the_spec_refuses(registry, checkpoint, overrides, reason):
    mono.register_spec()
    overrides = {k: str(checkpoint) if v == "CKPT" else v for k, v in overrides.items()}
    _, why = reasons(checkpoint, **overrides)
    assert reason in why, why


@pytest.mark.parametrize("disable_preshuffle", [None, "0", "1"])
def test_the_indexer_key_tiling_is_served_either_way(registry, checkpoint, monkeypatch,
                                                     disable_preshuffle):
    """SGLang's indexer keys row by row or in its 16 x 16 tiles: the spec asks for neither (the
    pool view reads SGLang's choice; the indexer kernels read and write both)."""
    if disable_preshuffle is None:
        monkeypatch.delenv("SGLANG_DSA_HIP_DISABLE_PRESHUFFLE", raising=False)
    else:
        monkeypatch.setenv("SGLANG_DSA_HIP_DISABLE_PRESHUFFLE", disable_preshuffle)
    mono.register_spec()
    spec, why = reasons(checkpoint)
    assert spec is mono.SPEC and why == []
    assert dict(mono.SPEC.requires.env) == {}


def test_handle_amd_monokernel_stops_the_server_with_every_reason(registry, checkpoint,
                                                                  monkeypatch):
    import sglang.srt.kernel_plugins.amd.binding as binding

    mono.register_spec()
    monkeypatch.setattr(binding, "device_isa", lambda: "gfx942")   # stand-in: the GPU's ISA
    with pytest.raises(ValueError) as e:
        binding.handle_amd_monokernel(server_args(checkpoint, tp_size=3,
                                                  enable_deterministic_inference=True))
    text = str(e.value)
    assert text.startswith("--enable-amd-monokernel cannot run this setup:")
    for reason in ("tp_size 3 is not one of", "--enable-deterministic-inference needs a BITWISE",
                   "--tp 3 needs each of these to be a multiple of 3"):
        assert reason in text


def test_config_checks_name_the_v41_fields_and_a_bad_geometry(checkpoint):
    from sglang.srt.arg_groups.overrides import model_config_of

    hf = model_config_of(server_args(checkpoint)).hf_config.to_dict()

    class Cfg:
        tp_size, page_size = 1, 256

    assert config_disable_reasons(Cfg, hf) == []
    why = config_disable_reasons(Cfg, dict(hf, engram_layer_ids=[1, 2]))
    assert why == ["config.engram_layer_ids=[1, 2]: this model has no such part (only [] is "
                   "supported)"]
    why = config_disable_reasons(Cfg, dict(hf, compress_ratios=[0, 2, 128, 4]))
    assert len(why) == 1 and "compress_ratios" in why[0]
    why = config_disable_reasons(Cfg, dict(hf, qk_nope_head_dim=128))
    assert why == ["the model config: hf_config: qk_nope_head_dim must be 448 (head_dim=512, "
                   "rope_head_dim=64), got 128"]


def test_after_load_a_weight_format_or_a_model_that_does_not_fit_are_named(checkpoint,
                                                                           monkeypatch):
    import torch

    from dsv4.plugins import sglang_mono_checks as checks
    from sglang.srt.arg_groups.overrides import model_config_of

    hf = model_config_of(server_args(checkpoint)).hf_config
    sglang_model = torch.nn.Module()      # stand-in: SGLang's model, no parameter to read
    sglang_model.config = hf
    with tp_ranks():
        assert checks.model_disable_reasons(sglang_model, hf, {}) == []
        awq = dict(hf.to_dict(), quantization_config={"quant_method": "awq"})
        assert checks.model_disable_reasons(sglang_model, awq, {}) == [
            "quantization_config {'quant_method': 'awq'} is neither the published DeepSeek-V4 "
            "format (FP8 e4m3 in 128x128 blocks with ue8m0 scales, FP4 experts) nor none (bf16 "
            "weights)"]
        monkeypatch.setattr(checks, "free_device_bytes", lambda: 1024)   # stand-in: free memory
        why = checks.model_disable_reasons(sglang_model, hf, {})
    assert len(why) == 1 and why[0].startswith("this project's model holds ")
    assert why[0].endswith("GiB a rank, more than the 0.00 GiB this device has free after "
                           "SGLang's weights loaded (use a larger --tp)")


def test_server_settings_whose_pool_or_outputs_are_not_served_are_named(monkeypatch):
    from dsv4.plugins.sglang_mono_checks import server_reasons

    class Cfg:
        dsv4_attn_backend, enable_encoder_swa_bounded_replay = "trtllm", True
        enable_return_hidden_states, enable_return_aux_hidden_states = True, False

    monkeypatch.setenv("SGLANG_HACK_FLASHMLA_BACKEND", "unified_kv_triton")
    assert server_reasons(Cfg) == [
        "--dsv4-attn-backend trtllm is not supported: its uniform FP8 pages are not the V4 "
        "layout",
        "--enable-encoder-swa-bounded-replay is not supported: its SWA KV lives in a request "
        "window",
        "--enable-return-hidden-states is not supported: the forward returns logits only",
        "SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton is not supported: the unified KV layout "
        "is not the V4 layout"]
    monkeypatch.delenv("SGLANG_HACK_FLASHMLA_BACKEND")

    class Default:
        dsv4_attn_backend = "auto"

    assert server_reasons(Default) == []


def test_before_load_a_model_that_cannot_be_held_twice_is_named(checkpoint, monkeypatch):
    from dsv4.plugins import sglang_mono_checks as checks
    from sglang.srt.arg_groups.overrides import model_config_of

    hf = model_config_of(server_args(checkpoint)).hf_config.to_dict()

    class Cfg:
        tp_size, page_size = 1, 256

    monkeypatch.setattr(checks, "device_total_bytes", lambda: 2**20)  # stand-in: a 1 MiB GPU
    why = checks.config_disable_reasons(Cfg, hf)
    assert len(why) == 1 and why[0].startswith("this project's model holds ")
    assert why[0].endswith("is more than the device's 0.0 GiB (use a larger --tp)")
    monkeypatch.setattr(checks, "device_total_bytes", lambda: 2**40)
    assert checks.config_disable_reasons(Cfg, hf) == []


def test_a_tp_rank_keeps_its_own_experts_and_splits_as_this_project_does(monkeypatch):
    """SGLang's TP group (a stand-in of two ranks) as this project's split; the load hook keeps
    a routed expert's tensors only on the rank that owns it, and of a split tensor only the
    rank's slice."""
    import types

    import torch

    from dsv4.plugins import sglang_mono_weights as weights

    model = types.SimpleNamespace(config=types.SimpleNamespace(
        num_hidden_layers=4, n_routed_experts=8, architectures=ARCH))
    monkeypatch.setattr(weights, "in_place", lambda model: {})
    kept = {}
    for rank in (0, 1):
        with tp_ranks(rank, 2):
            split = weights.rank_split()
            assert (split.rank, split.size) == (rank, 2)
            copies = {}
            for name in ("layers.1.ffn.experts.3.w1.weight", "layers.1.ffn.experts.4.w1.weight",
                         "layers.1.attn.wq_b.weight", "mtp.0.attn.wq_b.weight",
                         "layers.4.attn.wq_b.weight"):
                weights.load_tensor(copies, model, name, torch.arange(4.0))
            kept[rank] = {name: (part, t.tolist()) for (_, name, _, part), t in copies.items()}
    assert kept == {  # wq_b's rows are split, as this project's split cuts them
        0: {"layers.1.attn.wq_b.weight": ((0, 0, 2), [0.0, 1.0]),
            "layers.1.ffn.experts.3.w1.weight": (None, [0.0, 1.0, 2.0, 3.0])},
        1: {"layers.1.attn.wq_b.weight": ((0, 2, 2), [2.0, 3.0]),
            "layers.1.ffn.experts.4.w1.weight": (None, [0.0, 1.0, 2.0, 3.0])}}
