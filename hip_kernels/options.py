"""The kernel layer's options as one value: which backend runs an op, which host checks run, when
aiter is used, and the FP8 dialect the caches hold.

The `DSV4_*` flags are read once, by `KernelOptions.from_env()`, where a caller builds its options
(an engine, a model, a plugin's registration), and the platform's native FP8 dialect is resolved
there too; kernel wrappers take the value as an argument (`kernel`) and never read the environment
or ask the platform, so what a call computes is visible from its arguments and a captured graph
can compare one value to know whether it is still valid.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import envs, platform
from .platform import DIALECTS, OCP, Fp8Dialect

BACKENDS = ("auto", "hip", "triton", "torch")
AITER_MODES = ("auto", "0", "1")


@dataclass(frozen=True)
class KernelOptions:
    """backend: auto|hip|triton|torch (auto = HIP C++ where built on ROCm, else Triton on a GPU,
    else the torch reference); value_checks: range-check locations on the host before a store
    (one sync per op in eager mode, never inside capture); refuse_nonfinite: refuse NaN/inf K/V
    rows before a byte is written; aiter: auto|0|1 for the ops aiter maps; fp8_dialect: the FP8
    e4m3 dialect the KV caches are written and read in (`platform.FNUZ` or `platform.OCP`; the
    default, OCP, is the CPU's and most GPUs' dialect; `from_env` resolves the platform's)."""

    backend: str = "auto"
    value_checks: bool = True
    refuse_nonfinite: bool = False
    aiter: str = "auto"
    fp8_dialect: Fp8Dialect = OCP

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {'|'.join(BACKENDS)}")
        if self.aiter not in AITER_MODES:
            raise ValueError(f"aiter={self.aiter!r}: expected one of {'|'.join(AITER_MODES)}")
        if self.fp8_dialect not in DIALECTS.values():
            raise ValueError(f"fp8_dialect={self.fp8_dialect!r}: expected "
                             "hip_kernels.platform.FNUZ or hip_kernels.platform.OCP")

    @classmethod
    def from_env(cls) -> "KernelOptions":
        """The options the DSV4_* flags ask for (DSV4_KERNEL_BACKEND, DSV4_KERNEL_VALUE_CHECKS,
        DSV4_REFUSE_NONFINITE_KV, DSV4_AITER), with the FP8 dialect DSV4_FP8_DIALECT names or
        else the platform's native one."""
        return cls(backend=envs.KERNEL_BACKEND.get(), value_checks=envs.VALUE_CHECKS.get(),
                   refuse_nonfinite=envs.REFUSE_NONFINITE_KV.get(), aiter=envs.AITER.get(),
                   fp8_dialect=platform.fp8_dialect())


DEFAULT_KERNEL_OPTIONS = KernelOptions()
