"""Test setup shared by the whole suite.

The tests sit in area folders (kernels, mem_pool, model, runtime, plugins); the modules they share
sit in tests/helpers, which goes on the import path here. The Triton interpreter must be switched
on before the first `import triton` in the process, so it is set here, at collection time, unless
the run is on a GPU.
"""

import ctypes
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hip_kernels import flags  # noqa: E402

# One thread for the whole session, module- and session-scoped fixtures included (they are set up
# before any function-scoped fixture could take one): the models here are tiny, and on a busy
# 2-core machine OpenMP's hand-offs cost more than the ops (measured 4x slower with 2 threads).
# The processes the tests start take one thread themselves (the CLI, the benchmark scripts and
# the rank workers set it).
torch.set_num_threads(1)

# glibc's malloc gives large freed blocks back to the kernel (above a threshold that starts at
# 128 KiB and rises to at most 32 MiB), and the next allocation faults their pages in again,
# zeroed: the engine's prefill and decode allocate and free activations of that size in every
# op, which cost as much system time as the compute's user time (a 540-token tiny prefill:
# 5.6 s system, 7.1 s user; 0.5 s system with the thresholds below). Freed memory is kept for
# reuse instead, here (mallopt) and in every process the tests start (the environment). It
# changes no result, only where memory comes from.
KEEP_FREED_BYTES = 1 << 30
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
if platform.libc_ver()[0] == "glibc":
    for option, name in ((M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_"),
                         (M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_")):
        ctypes.CDLL(None).mallopt(option, KEEP_FREED_BYTES)
        os.environ.setdefault(name, str(KEEP_FREED_BYTES))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a ROCm/CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def flag_env(monkeypatch):
    """Set DSV4_* flags for one test: `flag_env(DSV4_X="1")`; cached values are refreshed."""
    import hip_kernels.platform as platform

    def set_flags(**values):
        for k, v in values.items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, str(v))
        flags.refresh()

    for name in list(os.environ):
        if name.startswith("DSV4_"):
            monkeypatch.delenv(name)
    flags.refresh()
    yield set_flags
    monkeypatch.undo()
    flags.refresh()
    platform.backend.cache_clear()
    platform.gpu_arch.cache_clear()
