"""Test setup shared by the whole suite.

The tests sit in area folders (kernels, mem_pool, model, runtime, plugins); the modules they share
sit in tests/helpers, which goes on the import path here. The Triton interpreter must be switched
on before the first `import triton` in the process, so it is set here, at collection time, unless
the run is on a GPU.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hip_kernels import flags  # noqa: E402


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


@pytest.fixture
def one_thread():
    """The tiny model's ops are far too small to share between threads: on a busy 2-core machine
    OpenMP's hand-offs cost more than the ops (measured 4x slower with 2 threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

