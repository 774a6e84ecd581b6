"""Side streams for the multi-stream prepare: real HIP/CUDA streams on a GPU, no-ops on a CPU
(the same code runs, in program order, and gives identical results)."""

from __future__ import annotations

import contextlib

import torch


class NullStream:
    """Stands in for a stream where there are none: waiting is a no-op."""

    def wait_stream(self, other) -> None:
        pass


def current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else NullStream()


def new_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else NullStream()


def on_stream(stream):
    """Context that makes `stream` current (nothing to do for a NullStream)."""
    if isinstance(stream, NullStream):
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)
