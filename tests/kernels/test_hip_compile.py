"""The HIP C++ set-KV kernel compiles for MI300 (gfx942), MI350 (gfx950) and sm_90, without a
GPU, and its binding compiles against torch's headers (see hip_kernels/hip_aot.py for how).

gfx942 with the fnuz dialect must use the hardware fp8 convert; no build may spill, use scratch
or call a function; division must stay IEEE (the bytes must match the torch reference).
"""

import pytest

from hip_kernels import hip_aot


def _or_skip(fn, *args):
    try:
        return fn(*args)
    except hip_aot.ToolMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hip_source(tmp_path_factory):
    _or_skip(hip_aot.hip_toolchain)
    work = tmp_path_factory.mktemp("hipify")
    return work, hip_aot.hipify_sources(work)


@pytest.fixture(scope="module")
def amd_stats(hip_source):
    work, source = hip_source
    stats = {arch: hip_aot.amdgcn_kernel_stats(hip_aot.compile_amdgcn(arch, source, work))
             for arch in hip_aot.AMD_ARCHS}
    print(stats)
    return stats


def test_hipify_rewrites_only_the_cuda_branch(hip_source):
    _, source = hip_source
    text = source.read_text()
    assert "hipLaunchKernelGGL" in text and "<<<" not in text
    assert '#include "kv_row_hip.cuh"' in text


@pytest.mark.parametrize("arch", hip_aot.AMD_ARCHS)
def test_amd_build_is_lean(amd_stats, arch):
    kernels = amd_stats[arch]
    assert set(kernels) == {"fnuz", "ocp"}
    for dialect, s in kernels.items():
        assert s["scratch_bytes"] == 0 and s["spills"] == 0, (arch, dialect, s)
        assert s["calls"] == 0, (arch, dialect, s)
        assert s["ieee_div"], (arch, dialect, "division was not compiled correctly rounded")
        assert s["vgpr"] <= 64, (arch, dialect, s)  # keeps 8 waves per SIMD


def test_gfx942_fnuz_uses_the_hardware_fp8_convert(amd_stats):
    s = amd_stats["gfx942"]
    # 8 values per lane: two v_cvt_pk_fp8_f32 per 4-byte word, two words
    assert s["fnuz"]["hw_fp8_converts"] == 4, s
    assert s["ocp"]["hw_fp8_converts"] == 0, s  # gfx942 has no OCP fp8: software rounding


def test_sm90_nvcc_build(tmp_path):
    stats = _or_skip(hip_aot.compile_sm90, tmp_path)
    print(stats)
    assert set(stats) == {"fnuz", "ocp"}
    for s in stats.values():
        assert s["spills"] == 0 and s["stack_bytes"] == 0, stats
        assert s["registers"] <= 64, stats


def test_binding_compiles_against_torch_headers():
    _or_skip(hip_aot.check_binding)

