"""Where we run: backend (rocm / cuda / cpu), GPU architecture, and the FP8 e4m3 dialect.

MI300 (gfx940/941/942) hardware fp8 is e4m3 *fnuz* (max 240, exponent bias 8); MI350/355
(gfx950), NVIDIA and the CPU default use OCP e4m3fn (max 448). The same byte read in the wrong
dialect is off by exactly 2x, so writers and readers must take the dialect from here.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from . import envs

logger = logging.getLogger(__name__)

FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")


class BackendUnavailable(RuntimeError):
    """A kernel backend that was asked for cannot run on this platform."""


@dataclass(frozen=True)
class Fp8Dialect:
    name: str            # "fnuz" | "ocp"
    torch_dtype: torch.dtype
    max: float           # largest finite magnitude
    triton_name: str     # Triton's name of the type: float8e4b8 | float8e4nv
    nan_byte: int        # the byte a NaN is stored as: 0x80 (fnuz, its only NaN) | 0x7F (OCP)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:      # the module constant it is (in KernelOptions' repr)
        return f"platform.{self.name.upper()}"


FNUZ = Fp8Dialect("fnuz", torch.float8_e4m3fnuz, 240.0, "float8e4b8", 0x80)
OCP = Fp8Dialect("ocp", torch.float8_e4m3fn, 448.0, "float8e4nv", 0x7F)
DIALECTS = {"fnuz": FNUZ, "ocp": OCP}


@functools.lru_cache(maxsize=None)
def backend() -> str:
    """'rocm', 'cuda' or 'cpu' (a GPU build without a visible device counts as cpu)."""
    if not torch.cuda.is_available():
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


@functools.lru_cache(maxsize=None)
def gpu_arch() -> str | None:
    """The GPU architecture: 'gfx942', 'gfx950', ... on ROCm, 'sm_90' style on CUDA, None on CPU."""
    b = backend()
    if b == "rocm":
        return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    if b == "cuda":
        major, minor = torch.cuda.get_device_capability(0)
        return f"sm_{major}{minor}"
    return None


def dialect_for_arch(arch: str | None) -> Fp8Dialect:
    """Native fp8 dialect of an architecture (None = CPU)."""
    return FNUZ if arch in FNUZ_ARCHS else OCP


def fp8_dialect() -> Fp8Dialect:
    """The active dialect: DSV4_FP8_DIALECT if set to fnuz|ocp, else the platform's native one."""
    choice = envs.FP8_DIALECT.get()
    if choice != "auto":
        return DIALECTS[choice]
    return dialect_for_arch(gpu_arch())


def triton_interpreted() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1, which triton reads when it is
    first imported): kernels then run on CPU tensors, and a few launchers pick the exact
    arithmetic the interpreter gets right over the fast one a GPU has."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_device() -> torch.device:
    return torch.device("cuda" if backend() != "cpu" else "cpu")


def describe() -> dict:
    """A one-line summary for logs, the CLI and benchmark records."""
    d = fp8_dialect()
    return {
        "backend": backend(),
        "gpu_arch": gpu_arch(),
        "gpu_name": torch.cuda.get_device_name(0) if backend() != "cpu" else None,
        "fp8_dialect": d.name,
        "fp8_max": d.max,
        "torch": torch.__version__,
        "hip": getattr(torch.version, "hip", None),
    }
