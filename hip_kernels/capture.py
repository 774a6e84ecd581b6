"""Whether a graph is being captured right now (real HIP/CUDA capture or the CPU emulation).

Captured code must not synchronize with the host, so value checks that need one (location
ranges) are skipped while capturing. The emulated capture lives in `dsv4.graphs`; it announces
itself here because this layer may not import `dsv4`.
"""

from __future__ import annotations

import torch

from .platform import backend

_emulated_capture = False
_on_gpu: bool | None = None     # backend() != "cpu", read once (is_capturing is on hot paths)


def set_emulated_capture(on: bool) -> None:
    global _emulated_capture
    _emulated_capture = bool(on)


def is_capturing() -> bool:
    global _on_gpu
    if _emulated_capture:
        return True
    if _on_gpu is None:
        _on_gpu = backend() != "cpu"
    return _on_gpu and torch.cuda.is_current_stream_capturing()
