"""The HIP C++ set-KV ops (sources in hip_kernels/csrc), built on first use.

torch.utils.cpp_extension compiles the CUDA-dialect sources: on ROCm it hipifies them and builds
with hipcc for the visible GPUs' architectures, on CUDA it uses nvcc. The library registers
torch.ops.dsv4_set_kv; it is built once per machine (cached under TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions) and loaded once per process. Without a GPU, a compiler or a
successful build, `available()` is False and `unavailable_reason()` says why; calling an op
then raises BackendUnavailable with that reason. Nothing is built at import.

Numerics: the kernels run `StoreNumerics` with the default fields but for `rms` ("exact" or
"device") and `q_mode` ("norm_rope" or "bf16_norm_rope"), so both DEFAULT_NUMERICS and
REFERENCE_NUMERICS; `supports(numerics)` says which, the ops raise ValueError for the rest.
Each store takes the arguments of its dispatcher op (`set_kv.SCHEMAS`), whose hip backend it is.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

from .numerics import DEFAULT_NUMERICS, StoreNumerics
from .platform import BackendUnavailable

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("set_kv_binding.cpp", "set_kv_kernels.cu")
LIBRARY = "dsv4_set_kv"

_state: dict = {}  # "ops" once built, or "error" once a build failed (never retried)


def _environment_problem() -> str:
    if not torch.cuda.is_available():
        return f"no ROCm/CUDA GPU is visible to torch {torch.__version__}"
    from torch.utils import cpp_extension

    if torch.version.hip and cpp_extension.ROCM_HOME is None:
        return "ROCm is not installed where torch looks for hipcc (set ROCM_HOME)"
    if not torch.version.hip and cpp_extension.CUDA_HOME is None:
        return "the CUDA toolkit (nvcc) is not installed where torch looks (set CUDA_HOME)"
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja): torch builds extensions with it"
    return ""


def _build_directory() -> Path:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    gpu = f"hip{torch.version.hip}" if torch.version.hip else f"cu{torch.version.cuda}"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_{gpu}"
    return Path(base) / tag.replace("+", "_").replace(".", "") / LIBRARY


def _stage_sources(build_dir: Path) -> Path:
    """Copy csrc into the build directory: on ROCm hipify writes its *_hip files next to the
    sources, which must not land in the package. Unchanged files are left alone."""
    src = build_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    for f in CSRC.iterdir():
        if f.suffix in (".cpp", ".cu", ".cuh", ".h"):
            dst = src / f.name
            if not dst.exists() or dst.read_bytes() != f.read_bytes():
                shutil.copyfile(f, dst)
    return src


def _build():
    from torch.utils.cpp_extension import load

    build_dir = _build_directory()
    src = _stage_sources(build_dir)
    load(name=LIBRARY, sources=[str(src / s) for s in SOURCES], extra_include_paths=[str(src)],
         extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], build_directory=str(build_dir),
         is_python_module=False)
    return getattr(torch.ops, LIBRARY)


def unavailable_reason() -> str:
    """'' when the extension is usable here, else why not. Builds it on the first call."""
    problem = _environment_problem()
    if problem:
        return problem
    if "ops" not in _state and "error" not in _state:
        try:
            _state["ops"] = _build()
        except Exception as e:  # a compiler error, a missing header, a failed dlopen...
            _state["error"] = f"building the HIP set-KV extension failed: {type(e).__name__}: {e}"
    return _state.get("error", "")


def available() -> bool:
    return not unavailable_reason()


def _ops():
    reason = unavailable_reason()
    if reason:
        raise BackendUnavailable(f"the HIP set-KV extension cannot run here: {reason}")
    return _state["ops"]


def _weight(weight: torch.Tensor) -> torch.Tensor:
    """The kernel reads bf16 or fp32 weights; fp16 is widened (exactly)."""
    return weight.float() if weight.dtype == torch.float16 else weight


KERNEL_RMS_MODES = ("exact", "device")
KERNEL_Q_MODES = ("norm_rope", "bf16_norm_rope")


def supports(numerics: StoreNumerics) -> bool:
    """Whether the kernels implement `numerics`: the defaults but for rms and q_mode."""
    return (numerics.rms in KERNEL_RMS_MODES and numerics.q_mode in KERNEL_Q_MODES
            and replace(numerics, rms=DEFAULT_NUMERICS.rms,
                        q_mode=DEFAULT_NUMERICS.q_mode) == DEFAULT_NUMERICS)


def _checked(numerics: StoreNumerics) -> StoreNumerics:
    if not supports(numerics):
        raise ValueError(f"the HIP set-KV kernels do not implement {numerics} (they take the "
                         f"default numerics with rms in {KERNEL_RMS_MODES} and q_mode in "
                         f"{KERNEL_Q_MODES})")
    return numerics


def fused_k_norm_rope_store(kv, weight, eps, freqs_cis, positions, out_loc, cache, page_size,
                            q, dialect: str, round_to_bf16: bool, fp8_max: float | None,
                            amax_floor: float, q_mode: str, rms: str) -> None:
    """rms: the KV row's norm; q_mode: the q heads' ("norm_rope" uses rms)."""
    _checked(StoreNumerics(round_to_bf16, fp8_max, amax_floor, q_mode, rms))
    _ops().k_norm_rope_store(kv, _weight(weight), float(eps), torch.view_as_real(freqs_cis),
                             positions, out_loc, cache, page_size, q, dialect == "fnuz", rms,
                             q_mode)


def fused_store_cache(rows, cache, out_loc, page_size, dialect: str, round_to_bf16: bool,
                      fp8_max: float | None, amax_floor: float, q_mode: str, rms: str) -> None:
    """Rows arrive normalized: rms and q_mode change nothing here."""
    _checked(StoreNumerics(round_to_bf16, fp8_max, amax_floor, q_mode, rms))
    _ops().store_cache(rows, cache, out_loc, page_size, dialect == "fnuz")


def fused_translate_norm_rope_store(kv, weight, eps, freqs_cis, positions, full_loc, full_to_swa,
                                    cache, page_size, swa_loc_out, q, dialect: str,
                                    round_to_bf16: bool, fp8_max: float | None,
                                    amax_floor: float, q_mode: str, rms: str) -> None:
    _checked(StoreNumerics(round_to_bf16, fp8_max, amax_floor, q_mode, rms))
    _ops().translate_norm_rope_store(kv, _weight(weight), float(eps),
                                     torch.view_as_real(freqs_cis), positions, full_loc,
                                     full_to_swa, cache, page_size, swa_loc_out,
                                     dialect == "fnuz", q, rms, q_mode)
