"""The vLLM plugin: its replacement of DeepseekV4Attention._fused_qnorm_rope_kv_insert writes
vLLM's SWA block layout and returns vLLM's q (checked against an independent restatement), falls
back to vLLM's own insert where it does not apply, and is installed by vLLM's own loader.

The README's test command installs the real vLLM 0.33.0 (`--no-deps`, beside SGLang); the loader
test runs vLLM's own `load_general_plugins` in fresh processes, and skips, saying so, only where
vLLM is absent. The other tests call the hook on a stand-in that has the attributes vLLM's layer
has (named as such)."""

import importlib.util
import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import v4_layout_encoder as E
from dsv4.plugins import vllm as plugin
from hip_kernels import KernelOptions
from hip_kernels import kv_layout as L

BLOCK, HEADS, EPS = 64, 2, 1e-6


def standin_layer(blocks=3, gap=576, dtype=torch.uint8, padded_heads=HEADS):
    """NOT vLLM: the attributes of vLLM 0.33's DeepseekV4Attention that the insert reads, with
    its SWA cache shaped as vLLM binds it ([blocks, block_size, 584] uint8, blocks stride(0)
    bytes apart: here the padded page plus `gap`)."""
    stride = L.page_bytes(BLOCK) + gap
    storage = torch.zeros(blocks * stride, dtype=torch.uint8)
    cache = storage.as_strided((blocks, BLOCK, L.TOKEN_BYTES), (stride, L.TOKEN_BYTES, 1))
    if dtype != torch.uint8:
        cache = torch.zeros(blocks, BLOCK, 512, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    angles = torch.rand(256, 32, generator=g) * 6.28
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)      # [max_pos, 64]: cos | sin
    return SimpleNamespace(
        swa_cache_layer=SimpleNamespace(prefix="model.layers.0.attn.swa", kv_cache=cache),
        rotary_emb=SimpleNamespace(cos_sin_cache=cos_sin), eps=EPS, n_local_heads=HEADS,
        padded_heads=padded_heads), storage


def inputs(n, seed=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS, 512, generator=g).to(torch.bfloat16)
    kv = (torch.randn(n, 512, generator=g) * 0.7).to(torch.bfloat16)
    return q, kv, torch.randint(0, 256, (n,), generator=g)


class Original:
    """Stands in for vLLM's own insert: records that it was called."""

    def __init__(self):
        self.calls = 0

    def __call__(self, layer, q, kv, positions, attn_metadata):
        self.calls += 1
        return "vllm's own"


def test_insert_writes_vllms_layout_and_returns_q(flag_env):
    flag_env(DSV4_KERNEL_BACKEND="torch")
    layer, storage = standin_layer()
    slots = [0, 63, 64, 130, -1, 191]
    q, kv, positions = inputs(len(slots) + 2)          # 2 padded rows past the slot mapping
    meta = {layer.swa_cache_layer.prefix: SimpleNamespace(
        slot_mapping=torch.tensor(slots), block_size=BLOCK)}
    original = Original()
    q_before = q.clone()
    q_out = plugin.insert_hook(original)(layer, q, kv, positions, meta)
    assert original.calls == 0
    assert torch.equal(q, q_before)                    # a new tensor; q itself untouched

    cs = layer.rotary_emb.cos_sin_cache[positions]
    cos, sin = cs[:, :32].numpy(), cs[:, 32:].numpy()
    # kv: no norm, RoPE in fp32 rounded to bf16, values as given; 224/448 as the dialect says
    rows = kv.float().numpy().copy()
    a, b = rows[:, 448::2].copy(), rows[:, 449::2].copy()
    rows[:, 448::2], rows[:, 449::2] = E.bf16(a * cos - b * sin), E.bf16(a * sin + b * cos)
    stride = L.page_bytes(BLOCK) + 576
    want = np.zeros((3, stride), np.uint8)
    pages = np.zeros((3, L.page_bytes(BLOCK)), np.uint8)
    E.encode_into(pages, BLOCK, slots, rows[:len(slots)], torch.float8_e4m3fn, 448.0, 1e-4)
    want[:, :L.page_bytes(BLOCK)] = pages
    assert np.array_equal(storage.numpy(), want.reshape(-1))

    # q: weightless RMSNorm and RoPE in fp32, one rounding, for every row
    x = q_before.float().numpy()
    r = np.float32(1) / np.sqrt(((x.astype(np.float64) ** 2).sum(-1, keepdims=True) / 512)
                                .astype(np.float32) + np.float32(EPS))
    y = x * r
    c, s = cos[:, None, :], sin[:, None, :]
    a, b = y[..., 448::2].copy(), y[..., 449::2].copy()
    y[..., 448::2], y[..., 449::2] = a * c - b * s, a * s + b * c
    assert torch.equal(q_out, torch.from_numpy(y).to(torch.bfloat16))


def test_the_insert_runs_with_the_kernel_options_it_was_made_with(monkeypatch):
    """register() reads the kernel flags once and builds the insert with them: a call passes
    that value to the kernel and reads no flag."""
    seen = []
    monkeypatch.setattr(plugin.set_kv, "fused_k_norm_rope_store",
                        lambda *args, **kwargs: seen.append(kwargs["kernel"]))
    layer, _ = standin_layer()
    q, kv, positions = inputs(2)
    meta = {layer.swa_cache_layer.prefix: SimpleNamespace(slot_mapping=torch.tensor([0, 1]),
                                                          block_size=BLOCK)}
    kernel = KernelOptions(backend="torch", value_checks=False)
    plugin.insert_hook(Original(), kernel)(layer, q, kv, positions, meta)
    assert seen == [kernel]


@pytest.mark.parametrize("case", ["profile run", "bf16 cache", "padded heads", "no metadata"])
def test_other_cases_keep_vllms_insert(flag_env, case):
    flag_env(DSV4_KERNEL_BACKEND="torch")
    layer, storage = standin_layer(dtype=torch.bfloat16 if case == "bf16 cache" else torch.uint8,
                                   padded_heads=HEADS + 2 if case == "padded heads" else HEADS)
    q, kv, positions = inputs(2)
    meta = {layer.swa_cache_layer.prefix: SimpleNamespace(slot_mapping=torch.tensor([1, 2]),
                                                          block_size=BLOCK)}
    meta = {"profile run": None, "no metadata": {}}.get(case, meta)
    original = Original()
    assert plugin.insert_hook(original)(layer, q, kv, positions, meta) == "vllm's own"
    assert original.calls == 1 and not storage.any()


def test_status_names_what_would_be_replaced():
    if importlib.util.find_spec("vllm") is None:
        assert plugin.status() == "vllm: not installed"
    else:
        assert plugin.status() == ("vllm 0.33.0: would replace "
                                   "DeepseekV4Attention._fused_qnorm_rope_kv_insert -> "
                                   "fused_k_norm_rope_store on torch")


def test_the_flag_off_is_said_and_nothing_is_looked_at(flag_env, monkeypatch, caplog):
    """In this process: DSV4_VLLM_PLUGIN=0 logs that the plugin is off, naming the flag as a
    user sets it, before anything of vLLM is inspected."""
    flag_env(DSV4_VLLM_PLUGIN="0")
    monkeypatch.setattr(plugin, "_problem", lambda: pytest.fail("vLLM was inspected"))
    with caplog.at_level(logging.INFO, logger="dsv4"):
        plugin.register()
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "vLLM plugin off" in caplog.text and "DSV4_VLLM_PLUGIN=0" in caplog.text


def test_a_failing_registration_is_logged_not_raised(flag_env, monkeypatch, caplog):
    """vLLM does not catch a plugin's exception: register() logs it with its traceback and says
    that vLLM's own insert stays (here the failure comes before anything is replaced)."""
    flag_env()

    def fails():
        raise RuntimeError("the signature check broke")

    monkeypatch.setattr(plugin, "_problem", fails)
    with caplog.at_level(logging.INFO, logger="dsv4"):
        plugin.register()
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and "the signature check broke" in caplog.text
    assert "vLLM plugin failed" in record.getMessage()
    assert "vLLM's own KV insert stays" in record.getMessage()


LOADER_CASES = [({}, True), ({"VLLM_PLUGINS": "other"}, False), ({"DSV4_VLLM_PLUGIN": "0"}, False)]

# vLLM's loader in one fresh process, the cases one after another: the first (the default
# environment) exactly as a server starts; before each later one the process is put back as it
# was (vLLM's once-per-process guard, our flags' cached values, the original method), so each
# case is vLLM's real load_general_plugins under its own environment, for one vLLM import.
LOADER = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
    import vllm.plugins
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention as A
    from hip_kernels import flags
    original = A.__dict__["_fused_qnorm_rope_kv_insert"]
    for i, env in enumerate(json.loads(sys.argv[1])):
        for name in ("VLLM_PLUGINS", "DSV4_VLLM_PLUGIN"):
            os.environ.pop(name, None)
        os.environ.update(env)
        flags.refresh()
        A._fused_qnorm_rope_kv_insert = original
        vllm.plugins.plugins_loaded = False
        print("CASE", i, flush=True)
        vllm.plugins.load_general_plugins()
        print("PATCHED", hasattr(A._fused_qnorm_rope_kv_insert, "__wrapped__"), flush=True)
""")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (the README's test command installs it: "
                           "requirements/vllm.txt)")
def test_vllm_loader_installs_the_plugin():
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "DSV4_VLLM_PLUGIN")}
    proc = subprocess.run([sys.executable, "-c", LOADER, json.dumps([e for e, _ in LOADER_CASES])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = proc.stdout.split("CASE ")[1:]
    assert len(cases) == len(LOADER_CASES), proc.stdout[-3000:]
    for (case_env, patched), out in zip(LOADER_CASES, cases):
        assert f"PATCHED {patched}" in out, (case_env, out[-3000:])
        assert ("vLLM 0.33.0 plugin active" in out) == patched, (case_env, out[-3000:])
        assert ("plugin off (DSV4_VLLM_PLUGIN=0)" in out) == ("DSV4_VLLM_PLUGIN" in case_env), \
            (case_env, out[-3000:])
