"""Which implementation runs an op, for every op family: `resolve(op, device, backend)` with the
backend a caller asks for (`KernelOptions.backend`: auto|hip|triton|torch).

auto = HIP C++ when its extension is built on ROCm (and the op has one), else Triton on a GPU,
else the torch reference. Asking for a backend that cannot run here raises, naming why.
The HIP C++ kernels implement the default `StoreNumerics` with a norm weight on contiguous caches:
a call outside that (`hip_ok=False`) runs on Triton (on a GPU), as an op without a HIP version.
A call the Triton kernel does not cover (`triton_ok=False`) runs the torch reference.
"""

from __future__ import annotations

import importlib.util

import torch

from . import set_kv_hip
from .options import BACKENDS
from .platform import BackendUnavailable, backend as platform_backend, triton_interpreted

HIP_OPS = ("fused_k_norm_rope_store", "fused_store_cache", "fused_translate_norm_rope_store")
__all__ = ["BackendUnavailable", "HIP_OPS", "hip_available", "resolve", "triton_usable"]


def hip_available() -> bool:
    """True when the HIP extension can be used (ROCm/CUDA device and a compiler to build it)."""
    if platform_backend() == "cpu":
        return False
    return set_kv_hip.available()


def triton_usable(device: torch.device) -> bool:
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return triton_interpreted() and importlib.util.find_spec("triton") is not None


def resolve(op: str, device: torch.device, backend: str, *, hip_ok: bool = True,
            triton_ok: bool = True) -> str:
    """The backend name ("hip", "triton" or "torch") that runs `op` for tensors on `device` when
    the caller asks for `backend` (auto|hip|triton|torch). hip_ok=False: a call the HIP kernel
    does not cover; triton_ok=False: a call the Triton kernel does not cover (the torch
    reference runs it, whatever was asked)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {'|'.join(BACKENDS)}")
    has_hip = op in HIP_OPS and hip_ok
    if backend == "torch" or (not triton_ok and not has_hip):
        return "torch"
    if backend == "hip":
        if not has_hip:  # no HIP version: Triton where it can run
            return "triton" if triton_ok and triton_usable(device) else "torch"
        if device.type != "cuda" or not hip_available():
            raise BackendUnavailable(
                f"backend=hip: the HIP set-KV extension cannot run here "
                f"(device {device}; {set_kv_hip.unavailable_reason()})")
        return "hip"
    if backend == "triton" and triton_ok:
        if not triton_usable(device):
            raise BackendUnavailable(
                f"backend=triton needs triton and a GPU tensor (got device {device}); "
                "on a CPU set TRITON_INTERPRET=1 before triton is first imported")
        return "triton"
    if device.type == "cuda":
        if has_hip and platform_backend() == "rocm" and hip_available():
            return "hip"
        if triton_ok and triton_usable(device):
            return "triton"
    return "torch"
