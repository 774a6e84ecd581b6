"""Which graph implementation captures and replays: auto|cuda|emulate (``Options.graph_backend``,
from DSV4_GRAPH_BACKEND).

cuda = `torch.cuda.CUDAGraph` (a HIP graph on ROCm); emulate = the CPU emulation in
`emulation.py`; auto = cuda for a step on a GPU, else emulate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from . import emulation


@dataclass(frozen=True)
class GraphBackend:
    name: str
    new_graph: Callable[[], Any]
    capture: Callable[[Any, Any], ContextManager]  # capture(graph, pool)
    pool_handle: Callable[[], Any]
    synchronize: Callable[[], None]


CUDA = GraphBackend(
    name="cuda",
    new_graph=lambda: torch.cuda.CUDAGraph(),
    capture=lambda g, pool: torch.cuda.graph(g, pool=pool),
    pool_handle=lambda: torch.cuda.graph_pool_handle(),
    synchronize=lambda: torch.cuda.synchronize(),
)

EMULATE = GraphBackend(
    name="emulate",
    new_graph=emulation.EmulatedGraph,
    capture=emulation.graph,
    pool_handle=emulation.graph_pool_handle,
    synchronize=lambda: None,
)


def select_backend(device: torch.device | str | None = None, choice: str = "auto") -> GraphBackend:
    """The backend `choice` (auto|cuda|emulate) names for a step whose tensors live on `device`
    (None: the default device). auto follows the device: a CUDA graph records only GPU work, so
    a step on the CPU (a CPU model on a machine that also has a GPU) takes the emulation, never
    an empty CUDA graph."""
    if choice not in ("auto", "cuda", "emulate"):
        raise ValueError(f"choice={choice!r}: expected one of auto|cuda|emulate")
    if choice == "auto":
        on_gpu = (torch.device(device).type == "cuda" if device is not None
                  else torch.cuda.is_available())
        choice = "cuda" if on_gpu else "emulate"
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("graph backend cuda (DSV4_GRAPH_BACKEND=cuda) needs a ROCm/CUDA GPU, "
                           "but torch.cuda.is_available() is False; use auto or emulate")
    return CUDA if choice == "cuda" else EMULATE
