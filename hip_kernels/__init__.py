"""Kernels of the DeepSeek-V4 decode backend: torch references, Triton kernels and HIP C++.

This package imports only torch (triton and compiled extensions are imported lazily inside the
functions that need them), so ``import hip_kernels`` works on a machine without triton.
"""

import logging

from . import envs, platform
from .platform import fp8_dialect

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["envs", "platform", "fp8_dialect"]
