"""Which implementation runs an op: DSV4_KERNEL_BACKEND=auto|hip|triton|torch.

auto = HIP C++ when its extension is built on ROCm (and the op has one), else Triton on a GPU,
else the torch reference. Asking for a backend that cannot run here raises, naming why.
The HIP C++ kernels implement the default `StoreNumerics` with a norm weight on contiguous caches:
a call outside that (`hip_ok=False`) runs on Triton (on a GPU), as an op without a HIP version.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from . import envs
from .platform import backend as platform_backend

HIP_OPS = ("fused_k_norm_rope_store", "fused_store_cache", "fused_translate_norm_rope_store")


class BackendUnavailable(RuntimeError):
    pass


def hip_available() -> bool:
    """True when the HIP extension can be used (ROCm/CUDA device and a compiler to build it)."""
    if platform_backend() == "cpu":
        return False
    from . import set_kv_hip
    return set_kv_hip.available()


def triton_usable(device: torch.device) -> bool:
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def resolve(op: str, device: torch.device, hip_ok: bool = True) -> str:
    """The backend name that will run `op` for tensors on `device` (hip_ok=False: a call the
    HIP kernel does not cover)."""
    choice = envs.KERNEL_BACKEND.get()
    has_hip = op in HIP_OPS and hip_ok
    if choice == "torch":
        return "torch"
    if choice == "hip":
        if not has_hip:  # no HIP version: Triton where it can run
            return "triton" if triton_usable(device) else "torch"
        if device.type != "cuda" or not hip_available():
            from . import set_kv_hip
            raise BackendUnavailable(
                f"DSV4_KERNEL_BACKEND=hip: the HIP set-KV extension cannot run here "
                f"(device {device}; {set_kv_hip.unavailable_reason()})")
        return "hip"
    if choice == "triton":
        if not triton_usable(device):
            raise BackendUnavailable(
                f"DSV4_KERNEL_BACKEND=triton needs triton and a GPU tensor (got device {device}); "
                "on a CPU set TRITON_INTERPRET=1 before triton is first imported")
        return "triton"
    if device.type == "cuda":
        if has_hip and platform_backend() == "rocm" and hip_available():
            return "hip"
        if triton_usable(device):
            return "triton"
    return "torch"


def implementation(backend_name: str):
    """The module holding the ops of a backend."""
    if backend_name == "torch":
        from . import set_kv_ref as mod
    elif backend_name == "triton":
        from . import set_kv_triton as mod
    else:
        from . import set_kv_hip as mod
    return mod
