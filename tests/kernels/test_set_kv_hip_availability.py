"""Whether the HIP C++ set-KV extension can run, and why not, on any machine: what
`unavailable_reason()` says for each missing piece, where the build goes, that a failed build is
not retried, and which numerics the kernels take. The build and the kernels themselves are
tested on a GPU (tests/kernels/test_set_kv_hip_gpu.py)."""

from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from hip_kernels import numerics as N
from hip_kernels import set_kv_hip
from hip_kernels.platform import BackendUnavailable


@pytest.fixture
def fresh_state(monkeypatch):
    """No build attempted yet in this process."""
    monkeypatch.setattr(set_kv_hip, "_state", {})


@pytest.fixture
def gpu(monkeypatch):
    """What torch reports on a machine with a ROCm GPU, the toolchain and ninja."""
    def machine(hip="6.2.41133", rocm_home="/opt/rocm", cuda_home=None, ninja="/usr/bin/ninja"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(cpp_extension, "ROCM_HOME", rocm_home)
        monkeypatch.setattr(cpp_extension, "CUDA_HOME", cuda_home)
        monkeypatch.setattr(set_kv_hip.shutil, "which",
                            lambda name: ninja if name == "ninja" else None)
    return machine


def test_without_a_gpu_the_reason_names_torch(monkeypatch, fresh_state):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert set_kv_hip.unavailable_reason() == (
        f"no ROCm/CUDA GPU is visible to torch {torch.__version__}")
    assert not set_kv_hip.available()
    with pytest.raises(BackendUnavailable, match="the HIP set-KV extension cannot run here: no "
                                                 "ROCm/CUDA GPU"):
        set_kv_hip._ops()


@pytest.mark.parametrize("machine, reason", [
    (dict(rocm_home=None), "ROCm is not installed where torch looks for hipcc (set ROCM_HOME)"),
    (dict(hip=None, rocm_home=None),
     "the CUDA toolkit (nvcc) is not installed where torch looks (set CUDA_HOME)"),
    (dict(ninja=None),
     "ninja is not installed (pip install ninja): torch builds extensions with it"),
])
def test_each_missing_tool_is_named(gpu, fresh_state, machine, reason):
    gpu(**machine)
    assert set_kv_hip.unavailable_reason() == reason


def test_a_failed_build_is_reported_and_not_retried(gpu, fresh_state, monkeypatch):
    gpu()
    attempts = []

    def failing_build():
        attempts.append(1)
        raise OSError("hipcc: not found")

    monkeypatch.setattr(set_kv_hip, "_build", failing_build)
    reason = "building the HIP set-KV extension failed: OSError: hipcc: not found"
    assert set_kv_hip.unavailable_reason() == reason
    assert set_kv_hip.unavailable_reason() == reason and attempts == [1]
    with pytest.raises(BackendUnavailable, match="OSError: hipcc: not found"):
        set_kv_hip._ops()


def test_a_successful_build_is_loaded_once(gpu, fresh_state, monkeypatch):
    gpu()
    built = []
    monkeypatch.setattr(set_kv_hip, "_build", lambda: built.append("ops") or "ops")
    assert set_kv_hip.available() and set_kv_hip._ops() == "ops" and set_kv_hip._ops() == "ops"
    assert built == ["ops"]


@pytest.mark.parametrize("hip, cuda, gpu_tag", [("6.2.41133", None, "hip6241133"),
                                                (None, "12.4", "cu124")])
def test_builds_for_each_python_torch_and_toolkit_go_to_their_own_directory(
        monkeypatch, tmp_path, hip, cuda, gpu_tag):
    import sys

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch, "__version__", "2.6.0+rocm6.2")
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    assert set_kv_hip._build_directory() == (
        tmp_path / f"py{py}_torch260_rocm62_{gpu_tag}" / set_kv_hip.LIBRARY)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(set_kv_hip.Path, "home", lambda: tmp_path / "home")
    assert set_kv_hip._build_directory().parent.parent == tmp_path / "home" / ".cache" / (
        "torch_extensions")


def test_the_build_is_optimized_goes_to_the_build_directory_and_gives_the_ops(
        monkeypatch, tmp_path):
    """What _build asks torch's extension loader for: host and device code at -O3, the staged
    sources, the per-toolkit build directory (not torch's default), a plain library whose ops
    register torch.ops.dsv4_set_kv, which it returns."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    asked = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: asked.append(kw))
    assert set_kv_hip._build() is getattr(torch.ops, set_kv_hip.LIBRARY)
    (kw,) = asked
    build_dir = set_kv_hip._build_directory()
    assert build_dir.is_relative_to(tmp_path) and kw["build_directory"] == str(build_dir)
    assert kw["name"] == set_kv_hip.LIBRARY and kw["is_python_module"] is False
    assert "-O3" in kw["extra_cflags"] and "-O3" in kw["extra_cuda_cflags"]
    assert kw["sources"] == [str(build_dir / "src" / s) for s in set_kv_hip.SOURCES]
    assert all(Path(s).is_file() for s in kw["sources"])


def test_sources_are_staged_beside_the_build_and_only_rewritten_when_changed(tmp_path):
    src = set_kv_hip._stage_sources(tmp_path)
    assert src == tmp_path / "src"
    staged = sorted(p.name for p in src.iterdir())
    assert staged == sorted(p.name for p in set_kv_hip.CSRC.iterdir()
                            if p.suffix in (".cpp", ".cu", ".cuh", ".h"))
    assert set(set_kv_hip.SOURCES) <= set(staged)
    kernel = src / "set_kv_kernels.cu"
    kernel.write_text("stale")
    binding = src / "set_kv_binding.cpp"
    before = binding.stat().st_mtime_ns
    set_kv_hip._stage_sources(tmp_path)
    assert kernel.read_bytes() == (set_kv_hip.CSRC / "set_kv_kernels.cu").read_bytes()
    assert binding.stat().st_mtime_ns == before


def test_the_kernels_take_the_default_numerics_with_either_rms_and_q_mode():
    from dataclasses import astuple, replace

    assert set_kv_hip.supports(N.DEFAULT_NUMERICS) and set_kv_hip.supports(N.REFERENCE_NUMERICS)
    for rms in set_kv_hip.KERNEL_RMS_MODES:
        for q_mode in set_kv_hip.KERNEL_Q_MODES:
            assert set_kv_hip.supports(replace(N.DEFAULT_NUMERICS, rms=rms, q_mode=q_mode))
    host = N.StoreNumerics(round_to_bf16=False, q_mode="rope_only")
    assert not set_kv_hip.supports(host)
    assert not set_kv_hip.supports(replace(N.DEFAULT_NUMERICS, round_to_bf16=False))
    with pytest.raises(ValueError, match="the HIP set-KV kernels do not implement"):
        set_kv_hip.fused_store_cache(None, None, None, 16, "ocp", *astuple(host))
    weight = torch.ones(4, dtype=torch.float16)
    assert set_kv_hip._weight(weight).dtype == torch.float32
    bf16 = weight.bfloat16()
    assert set_kv_hip._weight(bf16) is bf16
