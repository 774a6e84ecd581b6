"""KernelOptions.fp8_dialect: the FP8 dialect of the caches is a field of the kernel options,
resolved once with the platform by `KernelOptions.from_env()` (DSV4_FP8_DIALECT, else the
platform's native dialect); a kernel wrapper takes it from its `kernel` argument and never asks
the platform or the environment at call time."""

import pytest
import torch

import hip_kernels as hk
from hip_kernels import KernelOptions
from hip_kernels import kv_layout as L
from hip_kernels import platform

P = 4


def test_the_default_is_ocp_the_cpus_dialect():
    assert KernelOptions().fp8_dialect is platform.OCP
    assert hk.DEFAULT_KERNEL_OPTIONS.fp8_dialect is platform.OCP
    assert repr(KernelOptions(fp8_dialect=platform.FNUZ)).endswith("fp8_dialect=platform.FNUZ)")


def test_from_env_resolves_the_flag_then_the_platform(flag_env, monkeypatch):
    flag_env()
    assert KernelOptions.from_env().fp8_dialect is platform.OCP            # a CPU
    flag_env(DSV4_FP8_DIALECT="fnuz")
    assert KernelOptions.from_env().fp8_dialect is platform.FNUZ
    flag_env()
    monkeypatch.setattr(platform, "gpu_arch", lambda: "gfx942")             # an MI300
    assert KernelOptions.from_env().fp8_dialect is platform.FNUZ
    flag_env(DSV4_FP8_DIALECT="ocp")
    assert KernelOptions.from_env().fp8_dialect is platform.OCP


@pytest.mark.parametrize("bad", ["fnuz", None, torch.float8_e4m3fnuz])
def test_a_value_that_is_not_a_dialect_names_the_field(bad):
    with pytest.raises(ValueError, match=r"^fp8_dialect=.*: expected hip_kernels.platform.FNUZ "
                                         r"or hip_kernels.platform.OCP$"):
        KernelOptions(fp8_dialect=bad)


@pytest.mark.parametrize("flag, dialect", [("fnuz", platform.OCP), ("ocp", platform.FNUZ)])
def test_a_store_and_a_read_use_the_options_dialect_not_the_flag(flag_env, flag, dialect):
    """The flag says one dialect at call time, the options the other: the bytes are the
    options'. (fnuz and OCP bytes of the same values differ: fnuz is biased one more.)"""
    flag_env(DSV4_FP8_DIALECT=flag)
    kernel = KernelOptions(backend="torch", fp8_dialect=dialect)
    rows = (torch.randn(3, L.HEAD_DIM, generator=torch.Generator().manual_seed(1)) * 5).bfloat16()
    loc = torch.tensor([0, 5, 2])
    cache = torch.zeros(2, L.page_bytes(P), dtype=torch.uint8)
    hk.fused_store_cache(rows, cache, loc, P, kernel=kernel)
    nope, rope, scales = L.quantize_kv_rows(rows, dialect)
    want = torch.zeros_like(cache)
    hk.store_kv_pack(nope, rope, scales, want, loc, P, kernel=kernel)
    assert torch.equal(cache, want)
    other = L.quantize_kv_rows(rows, platform.DIALECTS[flag])[0]
    assert not torch.equal(nope.view(torch.uint8), other.view(torch.uint8))
    with pytest.raises(TypeError, match="nope_fp8 must have dtype"):
        hk.store_kv_pack(other, rope, scales, want, loc, P, kernel=kernel)
