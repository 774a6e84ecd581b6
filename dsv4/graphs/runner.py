"""Decode-step graphs: capture once per batch size, replay the smallest graph that fits.

The runner is generic over the step it captures:

    runner = GraphRunner(step_fn, make_static_inputs, max_batch,
                         invalidate_fn=pool.invalidate_loc_cache, options=options)
    runner.capture()
    logits = runner.replay({"input_ids": ..., "positions": ..., ...}, options)

- `make_static_inputs(n)` returns the static input buffers, name -> tensor with the batch in dim 0
  and n rows (input_ids, positions, seq_lens, req_pool_indices, out_cache_loc, and whatever else
  the step reads per row).
- `step_fn(inputs)` runs one decode step on such a dict (views of the first bs rows of each buffer)
  and returns a tensor, or a tuple/list/dict of tensors, with the batch in dim 0.
- `invalidate_fn()` runs before every warm-up and every capture run (the pool's
  `invalidate_loc_cache`), so no cached SWA translation lets a capture run skip the gather.
- `options` (a `dsv4.Options`): the step's options, which `step_fn` computes with, and the
  graphs' batch sizes and backend. A replay names the options of the step it stands for; if
  they differ from the captured ones in a field that changes what a step computes
  (`Options.STEP_FIELDS`), the replay raises `GraphFlagChanged` instead of silently running the
  old step.

Rows beyond the live batch are padded (default 0: request slot 0, location 0, the dummy slot), so
padded rows never write live KV. `replay` returns views of the static outputs: use them before the
next replay.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

import torch
from torch.utils._pytree import tree_map

from ..options import Options
from .backend import GraphBackend, select_backend

logger = logging.getLogger(__name__)

CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)

StaticInputs = dict[str, torch.Tensor]


class GraphFlagChanged(RuntimeError):
    """A replay's options differ from those the graphs were captured with."""


def capture_batch_sizes(max_batch: int, which: str = "pow2") -> list[int]:
    """which "pow2": CAPTURE_BATCH_SIZES up to max_batch, plus max_batch itself when it is
    smaller than the largest, so every batch the engine admits fits a graph; "every": 1 ..
    max_batch, so no batch is padded (a padded batch runs its GEMMs on more rows, and a CPU or
    GPU GEMM library may pick another kernel, and so another summation order, for another row
    count: the live rows' bits can change)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if which not in ("pow2", "every"):
        raise ValueError(f"which must be 'pow2' or 'every', got {which!r}")
    if which == "every":
        return list(range(1, max_batch + 1))
    sizes = [bs for bs in CAPTURE_BATCH_SIZES if bs <= max_batch]
    if max_batch < CAPTURE_BATCH_SIZES[-1] and sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class GraphRunner:
    def __init__(self, step_fn: Callable[[StaticInputs], Any],
                 make_static_inputs: Callable[[int], StaticInputs], max_batch: int,
                 invalidate_fn: Callable[[], None], *, options: Options,
                 pad_values: Mapping[str, int] | None = None,
                 backend: GraphBackend | None = None) -> None:
        if not isinstance(options, Options):
            raise TypeError(f"options must be a dsv4.Options, got {type(options).__name__}")
        self.step_fn = step_fn
        self.invalidate_fn = invalidate_fn
        self.options = options
        self.pad_values = dict(pad_values or {})
        self.batch_sizes = capture_batch_sizes(max_batch, options.graph_batch_sizes)
        self.static = make_static_inputs(self.max_batch)
        devices = {buf.device for buf in self.static.values()}
        self.backend = backend or select_backend(next(iter(devices)) if devices else None,
                                                 options.graph_backend)
        for name, buf in self.static.items():
            if buf.shape[0] != self.max_batch:
                raise ValueError(f"static input {name!r} has {buf.shape[0]} rows, expected "
                                 f"{self.max_batch} (the largest captured batch)")
        unknown = set(self.pad_values) - set(self.static)
        if unknown:
            raise ValueError(f"pad_values for unknown inputs {sorted(unknown)}; "
                             f"static inputs are {sorted(self.static)}")
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}

    @property
    def max_batch(self) -> int:
        """The largest batch a graph was (or will be) captured for."""
        return self.batch_sizes[-1]

    def graph_batch_size(self, n: int) -> int:
        """The smallest captured batch size that holds n rows."""
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"batch of {n} rows: graphs hold 1..{self.max_batch} rows")
        return next(bs for bs in self.batch_sizes if bs >= n)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture the step for every batch size, largest first, into one memory pool."""
        start = time.perf_counter()
        self.graphs, self.outputs = {}, {}
        self._pad_rows(0, self.max_batch)
        pool = self.backend.pool_handle()
        for bs in reversed(self.batch_sizes):
            inputs = {name: buf[:bs] for name, buf in self.static.items()}
            self.invalidate_fn()
            self.step_fn(inputs)  # warm-up: lazy initialisation happens outside the graph
            graph = self.backend.new_graph()
            self.invalidate_fn()  # the capture run must record the SWA gather, not a cache hit
            with self.backend.capture(graph, pool):
                self.outputs[bs] = self.step_fn(inputs)
            self.graphs[bs] = graph
        self.backend.synchronize()
        logger.info("captured %s graphs for batch sizes %s in %.2f s", self.backend.name,
                    self.batch_sizes, time.perf_counter() - start)

    @torch.no_grad()
    def replay(self, batch: Mapping[str, torch.Tensor], options: Options) -> Any:
        """Run the step on a live batch (name -> tensor, batch in dim 0) whose options are
        `options`; returns its first rows of the static outputs."""
        if not self.graphs:
            raise RuntimeError("replay() before capture()")
        changed = self.options.step_differences(options)
        if changed:
            raise GraphFlagChanged(
                f"the step's options differ from those the graphs were captured with "
                f"({'; '.join(changed)}); the graphs still do the old thing: replay with the "
                "captured options, or make a new engine (graph runner) with these")
        n = self._check_batch(batch)
        bs = self.graph_batch_size(n)
        for name, buf in self.static.items():
            buf[:n].copy_(batch[name])
        self._pad_rows(n, bs)
        self.graphs[bs].replay()
        return tree_map(lambda t: t[:n], self.outputs[bs])

    def _pad_rows(self, start: int, stop: int) -> None:
        for name, buf in self.static.items():
            buf[start:stop].fill_(self.pad_values.get(name, 0))

    def _check_batch(self, batch: Mapping[str, torch.Tensor]) -> int:
        missing, extra = set(self.static) - set(batch), set(batch) - set(self.static)
        if missing or extra:
            raise KeyError(f"batch inputs must be exactly {sorted(self.static)}; "
                           f"missing {sorted(missing)}, unexpected {sorted(extra)}")
        n = None
        for name, buf in self.static.items():
            t = batch[name]
            if t.shape[1:] != buf.shape[1:] or (n is not None and t.shape[0] != n):
                raise ValueError(f"batch input {name!r} has shape {tuple(t.shape)}; expected "
                                 f"({n if n is not None else 'n'}, *{tuple(buf.shape[1:])})")
            n = t.shape[0]
        return n
