import pytest
import torch

from hip_kernels import platform
from hip_kernels.backend import BackendUnavailable, resolve


def test_cpu_machine_reports_cpu_backend_and_no_arch():
    assert platform.backend() == "cpu"
    assert platform.gpu_arch() is None
    assert platform.default_device() == torch.device("cpu")


def test_native_dialect_per_architecture():
    for arch in ("gfx940", "gfx941", "gfx942"):
        d = platform.dialect_for_arch(arch)
        assert d.name == "fnuz" and d.max == 240.0 and d.torch_dtype == torch.float8_e4m3fnuz
    for arch in ("gfx950", "gfx90a", "sm_90", None):
        d = platform.dialect_for_arch(arch)
        assert d.name == "ocp" and d.max == 448.0 and d.torch_dtype == torch.float8_e4m3fn


def test_dialect_max_matches_torch_finfo():
    for d in platform.DIALECTS.values():
        assert torch.finfo(d.torch_dtype).max == d.max


def test_cpu_default_dialect_is_ocp(flag_env):
    flag_env()
    assert platform.fp8_dialect() is platform.OCP


def test_dialect_override(flag_env):
    flag_env(DSV4_FP8_DIALECT="fnuz")
    assert platform.fp8_dialect() is platform.FNUZ
    flag_env(DSV4_FP8_DIALECT="ocp")
    assert platform.fp8_dialect() is platform.OCP


def test_detection_on_a_simulated_mi300(flag_env, monkeypatch):
    flag_env()
    platform.backend.cache_clear()
    platform.gpu_arch.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)

    class Props:
        gcnArchName = "gfx942:sramecc+:xnack-"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    assert platform.backend() == "rocm"
    assert platform.gpu_arch() == "gfx942"
    assert platform.fp8_dialect() is platform.FNUZ
    flag_env(DSV4_FP8_DIALECT="ocp")
    assert platform.fp8_dialect() is platform.OCP


def test_describe_names_the_backend():
    d = platform.describe()
    assert d["backend"] == platform.backend() and d["fp8_dialect"] == platform.fp8_dialect().name


def test_asking_for_triton_on_a_cpu_says_how(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match=r"\(got device cpu\); on a CPU set "
                                                 r"TRITON_INTERPRET=1 before triton is first "
                                                 r"imported$"):
        resolve("fused_store_cache", torch.device("cpu"), "triton")


def test_triton_interpreted_is_the_interpreter_switch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert platform.triton_interpreted()
    for off in ("0", ""):
        monkeypatch.setenv("TRITON_INTERPRET", off)
        assert not platform.triton_interpreted()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not platform.triton_interpreted()
