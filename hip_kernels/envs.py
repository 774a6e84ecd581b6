"""Environment flags of the kernel layer."""

from .flags import bool_flag, choice_flag

PKG = "hip_kernels"

FP8_DIALECT = choice_flag(
    "DSV4_FP8_DIALECT", ("auto", "fnuz", "ocp"), "auto",
    "FP8 e4m3 dialect of KV caches: auto = fnuz on gfx940/941/942, OCP e4m3fn elsewhere", PKG)
KERNEL_BACKEND = choice_flag(
    "DSV4_KERNEL_BACKEND", ("auto", "hip", "triton", "torch"), "auto",
    "set-KV kernel backend: auto = HIP if built on ROCm, else Triton on a GPU, else torch", PKG)
VALUE_CHECKS = bool_flag(
    "DSV4_KERNEL_VALUE_CHECKS", True,
    "check location/position ranges before each set-KV launch (a host sync per op in eager mode; "
    "always skipped inside graph capture)", PKG)
REFUSE_NONFINITE_KV = bool_flag(
    "DSV4_REFUSE_NONFINITE_KV", False,
    "refuse K/V input holding NaN or inf before a byte is written (a host sync per op; skipped "
    "inside graph capture); off: such tiles are stored poisoned, as NaN bytes", PKG)
NUMERICS = choice_flag(
    "DSV4_NUMERICS", ("reference", "fp32"), "reference",
    "rounding of the model: reference = as DeepSeek-V4's reference inference code (bf16 steps, "
    "bit-exact with it for the same batch); fp32 = fp32 intermediates, stable across batches", PKG)
AITER = choice_flag(
    "DSV4_AITER", ("auto", "0", "1"), "auto",
    "aiter kernels for the ops hip_kernels/aiter_ops.py maps (indexer top-k, MoE gate): auto = "
    "only for ROCm tensors with DSV4_NUMERICS=fp32 (aiter's ties/rounding differ from the "
    "reference); "
    "1 = always, an error if aiter is not importable; 0 = never", PKG)
