"""Test-only fixes to Triton 3.7.1's interpreter so interpreted kernels match torch byte for byte.

1. Float conversions. The interpreter's `_convert_float` truncates fp32 -> bf16 (no rounding) and
   rounds fp32 -> fp8 with a dropped mantissa carry (about 3% of values differ). GPUs convert with
   round-to-nearest-even, as torch does, so the shim converts through torch.
2. The fnuz fp8 type `float8e4b8` (MI300) has no interpreter IR type; the shim adds it.

`install()` returns an `undo` callable; test modules import the `interpreter_shim` fixture;
`unshimmed()` runs a block under the interpreter as Triton ships it.
Only used when TRITON_INTERPRET=1; never on a GPU.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

_TORCH_FLOATS = {
    tl.float64: torch.float64, tl.float32: torch.float32, tl.float16: torch.float16,
    tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn,
    tl.float8e4b8: torch.float8_e4m3fnuz, tl.float8e5: torch.float8_e5m2,
}
_SAME_WIDTH_INT = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
_SHIPPED = interpreter._convert_float, interpreter._patch_lang_core


def _convert_float(input, input_dtype, output_dtype, rounding_mode):
    """Drop-in for interpreter._convert_float: RNE conversion of raw bits through torch."""
    if rounding_mode not in (None, interpreter._ir.ROUNDING_MODE.RTNE):
        raise NotImplementedError(f"shim: rounding mode {rounding_mode}")
    shape = np.shape(input)
    width = _SAME_WIDTH_INT[input_dtype.primitive_bitwidth]
    bits = np.ascontiguousarray(input).reshape(-1).view(width)
    x = torch.from_numpy(bits).view(_TORCH_FLOATS[input_dtype])
    y = x.to(_TORCH_FLOATS[output_dtype])
    return y.view(getattr(torch, f"int{output_dtype.primitive_bitwidth}")).numpy().reshape(shape)


def _with_fnuz_type(patch_lang_core):
    def patched(lang, scope):
        patch_lang_core(lang, scope)
        to_ir = lang.dtype.to_ir

        def to_ir_with_fnuz(self, builder):
            if self.name == "fp8e4b8":
                return builder.get_fp8e4b8_ty()
            return to_ir(self, builder)

        scope.set_attr(lang.dtype, "to_ir", to_ir_with_fnuz)
    return patched


def install():
    """Patch the interpreter; returns a callable that restores it."""
    saved = interpreter._convert_float, interpreter._patch_lang_core
    interpreter._convert_float = _convert_float
    interpreter._patch_lang_core = _with_fnuz_type(saved[1])

    def undo():
        interpreter._convert_float, interpreter._patch_lang_core = saved
    return undo


@contextlib.contextmanager
def unshimmed():
    """The interpreter's own conversions (and no fnuz type) inside the block, whatever is
    installed outside it."""
    saved = interpreter._convert_float, interpreter._patch_lang_core
    interpreter._convert_float, interpreter._patch_lang_core = _SHIPPED
    try:
        yield
    finally:
        interpreter._convert_float, interpreter._patch_lang_core = saved


@pytest.fixture(scope="module", autouse=True)
def interpreter_shim():
    """Autouse in every module that imports it: the shim is on while the module's tests run
    under the interpreter (and absent on a GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    undo = install()
    yield
    undo()
