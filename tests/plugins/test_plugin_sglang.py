"""The SGLang plugin against the real SGLang 0.5.23: loaded by SGLang's own loader, writing a
real DeepSeekV4TokenToKVPool built on the CPU, compared byte for byte with an independent encoder
of the layout and with SGLang's own torch writer of that layout."""

import json
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from sglang_host import install_cpu_context, make_pool, stub_path_env, use_stubs

use_stubs()
pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (see README)")

import v4_layout_encoder as E  # noqa: E402
from dsv4.plugins import sglang as plugin  # noqa: E402

PAGE = 256
# Page boundaries and the last slot of a page; -1 rows must write nothing.
SLOTS = [256, 511, 512, -1, 767, 300, -1, 257]
FP8 = torch.float8_e4m3fn  # the CPU's dialect (OCP)


@pytest.fixture(scope="module")
def loaded():
    """SGLang's loader run once in this process (the plugin found through its entry point)."""
    install_cpu_context()
    from sglang.srt.plugins import load_plugins

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dsv4").addHandler(handler)
    try:
        load_plugins()
    finally:
        logging.getLogger("dsv4").removeHandler(handler)
    return [r.getMessage() for r in records]


@pytest.fixture
def pool(loaded, flag_env):
    flag_env(DSV4_KERNEL_BACKEND="torch")
    return make_pool(swa_pages=3)


def rows_with_edge_tiles(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)
    x[0, :64] = 0.0             # an all-zero tile: the scale comes from the amax floor
    x[1, 64:128] = 3e-7         # a tiny tile: below SGLang's 1e-4 floor, above its 1e-8 one
    return x.to(torch.bfloat16)


def test_loader_installs_the_plugin(loaded):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool as P

    for name in plugin.REPLACEMENTS:
        assert getattr(P, name).__wrapped__ is not None, name
    active = [m for m in loaded if "plugin active" in m]
    assert len(active) == 1
    assert "set_swa_key_buffer_radix_fused -> fused_store_cache on torch" in active[0]
    assert "set_swa_key_buffer_radix_fused_norm_rope -> fused_k_norm_rope_store" in active[0]


def test_the_setter_hooks_carry_the_kernel_options_read_at_registration(loaded):
    """The plugin reads the kernel flags once, when SGLang loads it, and binds that value to the
    setter hooks (a setter call reads no flag)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from hip_kernels import KernelOptions

    for name in plugin.REPLACEMENTS:
        (hook,) = [h for _, h, _ in HookRegistry._hooks[f"{plugin.POOL}.{name}"]]
        assert hook.keywords == {"kernel": KernelOptions.from_env()}, name


def test_fused_store_writes_sglangs_bytes(pool):
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack
    from sglang.test.kernels.deepseek_v4.k_cache_reference import set_k_and_s_torch

    rows = rows_with_edge_tiles(len(SLOTS), seed=1)
    loc = torch.tensor(SLOTS, dtype=torch.int32)
    pool.set_swa_key_buffer_radix_fused(layer_id=1, swa_loc=loc, cache_k=rows)
    got = pool.get_swa_raw_buffer(1)
    assert got.shape[1] == E.page_stride(PAGE)

    want = np.zeros(tuple(got.shape), np.uint8)
    E.encode_into(want, PAGE, SLOTS, rows.float().numpy(), FP8, 448.0, amax_floor=1e-8)
    assert np.array_equal(got.numpy(), want)
    for other in (0, 2):
        assert not pool.get_swa_raw_buffer(other).any(), f"layer {other} was written"

    # SGLang's own torch writer of the layout, fed the encoder's packs, writes the same bytes.
    keep = [i for i, s in enumerate(SLOTS) if s >= 0]
    packs = [E.encode_row(rows[i].float().numpy(), FP8, 448.0, 1e-8) for i in keep]
    values = torch.tensor(np.frombuffer(b"".join(v for v, _ in packs), np.uint8).reshape(-1, 576))
    scales = torch.tensor(np.frombuffer(b"".join(s for _, s in packs), np.uint8).reshape(-1, 8))
    pack = NopeFp8RopeBf16Pack(values[:, :448].contiguous().view(FP8),
                               values[:, 448:].contiguous().view(torch.bfloat16),
                               scales[:, :7].contiguous())
    theirs = torch.zeros_like(got)
    set_k_and_s_torch(theirs, torch.tensor([SLOTS[i] for i in keep]), pack, PAGE)
    assert torch.equal(got, theirs)


@pytest.mark.parametrize("dialect, fp8, fp8_max", [("ocp", torch.float8_e4m3fn, 448.0),
                                                    ("fnuz", torch.float8_e4m3fnuz, 224.0)])
def test_fused_norm_rope_writes_kv_and_ropes_q(pool, dialect, fp8, fp8_max):
    """On gfx942 (fnuz) SGLang's norm+RoPE kernel clamps to 224: so does the plugin. The hook
    runs as SGLang calls it, bound to the KernelOptions of a platform of that dialect."""
    from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref

    from hip_kernels import KernelOptions
    from hip_kernels.platform import DIALECTS

    n, heads, eps = len(SLOTS), 2, 1e-6
    g = torch.Generator().manual_seed(5)
    qkv_a = torch.randn(n, 64 + 512, generator=g).to(torch.bfloat16)
    kv = qkv_a[:, 64:]                                      # a strided slice, as SGLang passes it
    weight = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    angles = torch.rand(64, 32, generator=g) * 6.28
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    positions = torch.randint(0, 64, (n,), generator=g)
    q = torch.randn(n, heads, 512, generator=g).to(torch.bfloat16)
    q_before = q.clone()
    loc = torch.tensor(SLOTS, dtype=torch.int32)

    kernel = KernelOptions(backend="torch", fp8_dialect=DIALECTS[dialect])
    plugin.fused_norm_rope_hook(None, pool, layer_id=0, swa_loc=loc, kv=kv, kv_weight=weight,
                                eps=eps, freqs_cis=freqs_cis, positions=positions, q=q,
                                kernel=kernel)

    f = freqs_cis[positions]
    cos, sin = f.real.numpy(), f.imag.numpy()
    rows = E.norm_rope_fp32(kv.float().numpy(), weight.float().numpy(), eps, cos, sin)
    want = np.zeros(tuple(pool.get_swa_raw_buffer(0).shape), np.uint8)
    E.encode_into(want, PAGE, SLOTS, rows, fp8, fp8_max, amax_floor=1e-4)
    assert np.array_equal(pool.get_swa_raw_buffer(0).numpy(), want)

    if dialect == "ocp":  # SGLang's own reader of its layout (OCP on a CPU) gets the rows back
        live = [i for i, s in enumerate(SLOTS) if s >= 0]
        read = dequantize_k_cache_paged_ref(pool.get_swa_raw_buffer(0),
                                            torch.tensor([SLOTS[i] for i in live]), PAGE)[:, 0]
        expect = torch.from_numpy(rows[live])
        assert ((read.float() - expect).abs() <= expect.abs() * 2 ** -3 + 1e-3).all()

    # q: every row (negative slots included) has its last 64 dims rotated, nothing else.
    assert torch.equal(q[..., :448], q_before[..., :448])
    c, s = f.real.unsqueeze(1).double(), f.imag.unsqueeze(1).double()
    a, b = q_before[..., 448::2].double(), q_before[..., 449::2].double()
    re = (a * c + (-(b * s)).float().double()).float()
    im = (b * c + (a * s).float().double()).float()
    assert torch.equal(q[..., 448:], torch.stack([re, im], -1).flatten(-2).to(torch.bfloat16))


@pytest.mark.parametrize("attribute, value, reason", [
    ("uniform_fp8", True, "it keeps uniform FP8 pages"),
    ("_unified_kv", True, "unified KV layout"),
], ids=["uniform fp8", "unified kv"])
def test_other_pool_kinds_keep_sglangs_setters(pool, caplog, attribute, value, reason):
    """The log line a user reads says which kind of pool keeps SGLang's setters."""
    setattr(pool, attribute, value)
    rows = rows_with_edge_tiles(2, seed=2)
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        with pytest.raises(Exception):  # SGLang's own setter needs its GPU kernel
            pool.set_swa_key_buffer_radix_fused(1, torch.tensor([256, 257]), rows)
    assert not pool.get_swa_raw_buffer(1).any()
    assert "keeps SGLang's own SWA setters" in caplog.text and reason in caplog.text


def test_different_signatures_patch_nothing(monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    methods = plugin.class_methods(plugin.POOL_MODULE, plugin.POOL_CLASS)
    assert plugin.plan(methods)[1] is None
    changed = dict(methods, set_swa_key_buffer_radix_fused=("self", "layer_id", "loc", "k"))
    monkeypatch.setattr(plugin, "class_methods", lambda *a: changed)
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        plugin.register()
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before
    lines = [r for r in caplog.records
             if r.name.startswith("dsv4") and "monokernel" not in r.getMessage()]
    assert len(lines) == 1 and "not patched" in lines[0].getMessage()
    assert "set_swa_key_buffer_radix_fused('self', 'layer_id', 'loc', 'k') differs" in caplog.text


# SGLang's loader in one fresh process, the scenarios one after another: the two that must
# patch nothing first, then the two that patch (what they print is the registry's list of
# patched methods, and SGLang's spec lookup, which a second patch does not change). Before each,
# SGLang's once-per-process guard, its hook and spec registries and our cached flags are reset,
# so each scenario is SGLang's real load_plugins under its own environment, for one SGLang
# import.
LOADER = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
    import sglang.srt.plugins as plugins
    import sglang.kernels.plugin_kernels.amd.spec as mono
    from sglang.srt.plugins.hook_registry import HookRegistry
    from hip_kernels import flags
    for env in json.loads(sys.argv[1]):
        for name in ("SGLANG_PLUGINS", "DSV4_SGLANG_PLUGIN", "DSV4_SGLANG_MONOKERNEL"):
            os.environ.pop(name, None)
        os.environ.update(env)
        flags.refresh()
        HookRegistry.reset()
        mono._REGISTRY.clear()
        plugins._plugins_loaded = False
        print("SCENARIO", flush=True)
        plugins.load_plugins()
        ours = sorted(t.rsplit(".", 1)[1] for t in HookRegistry._patched if "DeepSeekV4" in t)
        print("PATCHED", ours, flush=True)
        spec, why = mono.find_spec(backend="amd", architectures=["DeepseekV4ForCausalLM"],
                                   isa="gfx942")
        print("SPEC", spec.name if spec else None, flush=True)
""")


SCENARIOS = [  # (environment, whether our hooks get applied, whether SGLang finds the spec)
    ({"SGLANG_PLUGINS": "some_other_plugin"}, False, False),
    ({"DSV4_SGLANG_PLUGIN": "0"}, False, False),
    ({"DSV4_SGLANG_MONOKERNEL": "0"}, True, False),
    ({"SGLANG_PLUGINS": "dsv4_rocm"}, True, True),
]


def test_loader_in_a_fresh_process():
    env = {k: v for k, v in stub_path_env().items()
           if k not in ("SGLANG_PLUGINS", "DSV4_SGLANG_PLUGIN", "DSV4_SGLANG_MONOKERNEL")}
    proc = subprocess.run([sys.executable, "-c", LOADER,
                           json.dumps([e for e, *_ in SCENARIOS])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs = proc.stdout.split("SCENARIO\n")[1:]
    assert len(outs) == len(SCENARIOS), proc.stdout[-2000:]
    names = sorted(plugin.REPLACEMENTS)
    for out, (scenario_env, patched, spec) in zip(outs, SCENARIOS):
        line = [x for x in out.splitlines() if x.startswith("PATCHED")][0]
        assert line == f"PATCHED {names if patched else []}", scenario_env
        line = [x for x in out.splitlines() if x.startswith("SPEC")][0]
        assert line == f"SPEC {'dsv4-rocm' if spec else None}", scenario_env
        assert ("SGLang plugin off (DSV4_SGLANG_PLUGIN=0)" in out) == \
            ("DSV4_SGLANG_PLUGIN" in scenario_env), scenario_env


def test_status_line_says_what_would_be_replaced_or_why_not(monkeypatch, flag_env):
    """The line `python -m dsv4 env` prints for SGLang, in each case a user can meet."""
    version = plugin.installed_version("sglang")
    pool = plugin.POOL_CLASS
    flag_env(DSV4_KERNEL_BACKEND="torch")
    assert plugin.status() == (
        f"sglang {version}: would replace {pool}.set_swa_key_buffer_radix_fused -> "
        f"fused_store_cache on torch; {pool}.set_swa_key_buffer_radix_fused_norm_rope -> "
        "fused_k_norm_rope_store on torch")
    flag_env(DSV4_KERNEL_BACKEND="torch", DSV4_SGLANG_PLUGIN="0")
    assert plugin.status() == f"sglang {version}: plugin off (DSV4_SGLANG_PLUGIN=0)"
    flag_env(DSV4_SGLANG_PLUGIN=None)
    methods = plugin.class_methods(plugin.POOL_MODULE, plugin.POOL_CLASS)
    without = {k: v for k, v in methods.items() if k != "set_swa_key_buffer_radix_fused"}
    monkeypatch.setattr(plugin, "class_methods", lambda *a: without)
    assert plugin.status() == (f"sglang {version}: nothing would be replaced "
                               f"({pool}.set_swa_key_buffer_radix_fused is missing)")
    monkeypatch.setattr(plugin, "installed_version", lambda name: None)
    assert plugin.status() == "sglang: not installed"


def test_the_legacy_location_cache_is_replaced_only_where_sglang_has_it():
    methods = plugin.class_methods(plugin.POOL_MODULE, plugin.POOL_CLASS)
    legacy = dict(methods, get_cached_swa_loc=("self", "raw_loc", "layer_id"))
    chosen, problem = plugin.plan(legacy)
    assert problem is None and list(chosen) == [*plugin.REPLACEMENTS, "get_cached_swa_loc"]
    assert plugin.describe_plan({"get_cached_swa_loc": chosen["get_cached_swa_loc"]}) == (
        f"{plugin.POOL_CLASS}.get_cached_swa_loc -> identity-keyed SWA location cache")
    _, problem = plugin.plan(dict(methods, get_cached_swa_loc=("self", "loc")))
    assert problem == (f"{plugin.POOL_CLASS}.get_cached_swa_loc('self', 'loc') differs from the "
                       "expected ('self', 'raw_loc', 'layer_id')")
    assert plugin.plan(None) == ({}, f"{plugin.POOL} is not installed")


def test_the_plan_runs_on_triton_what_the_hip_kernels_numerics_do_not_cover(monkeypatch,
                                                                            flag_env):
    """On ROCm with the HIP extension built, the HIP kernels write only the default numerics:
    SGLang's (a 1e-8 amax floor for the plain store, fp32 norm and RoPE for the fused one) go to
    Triton; were they the default, the plan would name HIP."""
    import hip_kernels.backend as backend
    from hip_kernels import numerics

    flag_env()                                         # DSV4_KERNEL_BACKEND unset: auto
    monkeypatch.setattr(plugin, "default_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(backend, "platform_backend", lambda: "rocm")
    monkeypatch.setattr(backend, "hip_available", lambda: True)
    pool = plugin.POOL_CLASS
    assert plugin.describe_plan(plugin.REPLACEMENTS) == (
        f"{pool}.set_swa_key_buffer_radix_fused -> fused_store_cache on triton; "
        f"{pool}.set_swa_key_buffer_radix_fused_norm_rope -> fused_k_norm_rope_store on triton")
    monkeypatch.setattr(plugin, "sglang_numerics", lambda op, dialect: numerics.DEFAULT_NUMERICS)
    assert plugin.describe_plan(plugin.REPLACEMENTS) == (
        f"{pool}.set_swa_key_buffer_radix_fused -> fused_store_cache on hip; "
        f"{pool}.set_swa_key_buffer_radix_fused_norm_rope -> fused_k_norm_rope_store on hip")
