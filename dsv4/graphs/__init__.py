"""Decode-step graphs: HIP/CUDA graphs on a GPU, a recording emulation on a CPU, and the runner
that captures a step per batch size and replays it."""

from hip_kernels.capture import is_capturing as currently_capturing

from .backend import GraphBackend, select_backend
from .emulation import EmulatedGraph, GraphCaptureError
from .runner import CAPTURE_BATCH_SIZES, GraphFlagChanged, GraphRunner, capture_batch_sizes

__all__ = [
    "currently_capturing", "GraphBackend", "select_backend", "EmulatedGraph", "GraphCaptureError",
    "GraphFlagChanged", "CAPTURE_BATCH_SIZES", "GraphRunner",
    "capture_batch_sizes",
]
