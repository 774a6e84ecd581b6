"""The HIP C++ set-KV kernel's logic built as a host (CPU) torch extension: torch.ops.dsv4_set_kv_host.

tests/csrc/set_kv_host_harness.cpp compiles hip_kernels/csrc as host C++. One build directory per
test session, so every module that asks gets the one library (a second build would register the
same op names again).
"""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def build_host_ops(tmp_path_factory):
    """torch.ops.dsv4_set_kv_host, built once per session; skips without ninja or a compiler."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        pytest.skip("ninja is not installed: torch builds C++ extensions with it")
    build = tmp_path_factory.getbasetemp() / "set_kv_host"
    build.mkdir(exist_ok=True)
    try:
        cpp_extension.load(
            name="dsv4_set_kv_host", sources=[str(ROOT / "tests/csrc/set_kv_host_harness.cpp")],
            extra_include_paths=[str(ROOT / "hip_kernels/csrc")],
            extra_cflags=["-O1", "-ffp-contract=off"], build_directory=str(build),
            is_python_module=False)
    except (OSError, RuntimeError) as e:
        if cpp_extension.get_cxx_compiler() and "error:" in str(e):
            raise
        pytest.skip(f"no working C++ compiler: {e}")
    return torch.ops.dsv4_set_kv_host
