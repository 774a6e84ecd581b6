"""CPU graph capture/replay with the surface of `torch.cuda.CUDAGraph`, to prove graph safety
without a GPU.

Capture runs the code once, eagerly, under a TorchDispatchMode that records every aten op that
executes as (op, args, kwargs, outputs). Replay re-runs only those ops, on the very tensor objects
seen at capture: the graph is a static dataflow over the captured tensors, and whatever Python did
around the ops (cache lookups, dict updates, branches) is frozen at capture, as on a GPU.

- In-place and `out=` ops run again, in place.
- Ops that allocate their outputs (functional ops, factories such as zeros/arange, RNG ops) run
  again and their results are copied into the tensors recorded at capture; those are the graph's
  static tensors, which later ops read. RNG ops draw fresh numbers from the global generator at
  every replay, as a CUDA graph advances its Philox offset.
- Views (outputs sharing storage with an input) are not re-run: the recorded view already shares
  storage with its base. Bare allocations (empty*) are not re-run either: their contents are
  undefined, on a GPU too.

Capture refuses what a GPU graph cannot contain, with an error naming the operation: reading
tensor data on the host (.item(), int(), bool(), .tolist(), .numpy(), ops that return a Python
value such as torch.equal) and ops whose output shape depends on data (nonzero, masked_select,
unique, bool-mask indexing, repeat_interleave without output_size, bincount). Data reaches the host
only through those, so no allocation inside capture can depend on data. Kernels launched outside
the torch dispatcher cannot be recorded: Triton launches are refused; a compiled extension must be
registered as a torch.library op to be captured.
"""

from __future__ import annotations

import importlib.util
import logging
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hip_kernels.capture import set_emulated_capture

logger = logging.getLogger(__name__)

_active_graph: "EmulatedGraph | None" = None

# Overload packets (aten op names) with special treatment.
_ALLOCATION_ONLY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_DATA_DEPENDENT_SHAPE = {"nonzero", "nonzero_numpy", "argwhere", "masked_select", "_unique",
                         "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
                         "bincount"}
_INDEXING = {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_",
             "_unsafe_index_put"}
_REPEATS_FROM_TENSOR = (torch.ops.aten.repeat_interleave.Tensor,
                        torch.ops.aten.repeat_interleave.self_Tensor)


class GraphCaptureError(RuntimeError):
    """Captured code did something a graph cannot contain (host sync, data-dependent shape)."""


def is_capturing() -> bool:
    """True while an emulated capture runs in this process (see also `currently_capturing`)."""
    return _active_graph is not None


class EmulatedPool:
    """Stand-in for `torch.cuda.graph_pool_handle()`: graphs captured into one pool share it.

    CPU memory is not pooled; the pool tallies the static tensors its graphs hold.
    """

    def __init__(self) -> None:
        self.graphs = 0
        self.static_bytes = 0


def graph_pool_handle() -> EmulatedPool:
    return EmulatedPool()


@dataclass(frozen=True)
class RecordedOp:
    """One aten op executed during capture, with the tensor objects it read and wrote."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    outputs: Any
    static_outputs: tuple[torch.Tensor, ...]  # allocated by the op; replay refills them
    static_positions: tuple[int, ...]  # their positions among _returned_tensors(outputs)
    rerun: bool  # False for views and bare allocations
    # The op's out= overload when it has one for this call: replay then writes the static output
    # directly, with no second allocation and no copy (what a GPU graph does: a kernel writes
    # into the graph's memory).
    out_func: torch._ops.OpOverload | None = None

    def replay(self) -> None:
        if not self.rerun:
            return
        if self.out_func is not None:
            self.out_func(*self.args, **self.kwargs, out=self.static_outputs[0])
            return
        result = _returned_tensors(self.func, self.func(*self.args, **self.kwargs))
        for static, i in zip(self.static_outputs, self.static_positions):
            if static.shape != result[i].shape:
                raise GraphCaptureError(
                    f"replay of {self.func}: output shape {tuple(result[i].shape)} differs from "
                    f"{tuple(static.shape)} at capture; a captured tensor was resized")
            static.copy_(result[i])


def _returned_tensors(func, out) -> list[torch.Tensor | None]:
    """The returned tensors, except those the op wrote in place (self / out= arguments)."""
    returns = func._schema.returns
    values = (out,) if len(returns) == 1 else tuple(out or ())
    tensors = []
    for ret, value in zip(returns, values):
        if ret.alias_info is None or not ret.alias_info.is_write:
            tensors.extend(value if isinstance(value, (list, tuple)) else [value])
    return tensors


def _record(func, args: tuple, kwargs: dict, out) -> RecordedOp:
    # A return that "may alias" (aten.to, _unsafe_view...) is a view only if it shares storage
    # with an input; otherwise it is a tensor the op allocated.
    input_storages = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.numel()}
    positions = tuple(i for i, t in enumerate(_returned_tensors(func, out))
                      if isinstance(t, torch.Tensor) and t.numel()
                      and t.untyped_storage().data_ptr() not in input_storages)
    static = tuple(_returned_tensors(func, out)[i] for i in positions)
    mutates = any(a.alias_info is not None and a.alias_info.is_write
                  for a in func._schema.arguments)
    rerun = (func.overloadpacket.__name__ not in _ALLOCATION_ONLY
             and (mutates or bool(static) or not func._schema.returns))
    out_func = None
    if rerun and not mutates and positions == (0,) and len(func._schema.returns) == 1:
        out_func = _out_overload(func)
    return RecordedOp(func, args, kwargs, out, static, positions, rerun, out_func)


def _out_overload(func) -> torch._ops.OpOverload | None:
    """The out= overload taking exactly func's arguments plus `out`, if the op has one."""
    name = func._overloadname
    arguments = [(a.name, str(a.type)) for a in func._schema.arguments]
    for candidate in ("out",) if name == "default" else (f"{name}_out", "out"):
        overload = getattr(func.overloadpacket, candidate, None)
        if overload is None:
            continue
        schema = overload._schema
        outs = [a.name for a in schema.arguments if a.is_out]
        if outs == ["out"] and [(a.name, str(a.type)) for a in schema.arguments
                                if not a.is_out] == arguments:
            return overload
    return None


def _is_tensor_type(t) -> bool:
    if isinstance(t, (torch.ListType, torch.OptionalType)):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def _refusal(func, args: tuple, kwargs: dict) -> str | None:
    """Why `func` cannot be captured, or None."""
    name = func.overloadpacket.__name__
    if name == "_local_scalar_dense":
        return ("Tensor.item() / int() / float() / bool() of a tensor (aten._local_scalar_dense) "
                "copies a tensor value to the host")
    if name in _DATA_DEPENDENT_SHAPE:
        return f"aten.{name} ({func}) has an output shape that depends on tensor data"
    if func in _REPEATS_FROM_TENSOR and kwargs.get("output_size") is None:
        return ("torch.repeat_interleave with tensor repeats and no output_size "
                f"({func}) has an output shape that depends on tensor data")
    if name in _INDEXING and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                 for i in args[1]):
        return (f"boolean-mask indexing ({func}) has a data-dependent shape "
                "(it runs nonzero); use torch.where or index with integer tensors")
    if not all(_is_tensor_type(r.type) for r in func._schema.returns):
        return f"{func} returns a Python value computed from tensor data"
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[RecordedOp]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _refusal(func, args, kwargs)
        if reason is not None:
            raise GraphCaptureError(f"inside graph capture: {reason}; captured code must not "
                                    "synchronize with the host")
        out = func(*args, **kwargs)
        self.ops.append(_record(func, args, kwargs, out))
        return out


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise GraphCaptureError(f"inside graph capture: {what}; captured code must not "
                                "synchronize with the host")
    return refuse


@contextmanager
def _patched(owner, name: str, replacement) -> Iterator[None]:
    had_own = name in owner.__dict__
    original = owner.__dict__.get(name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def _refuse_what_bypasses_the_dispatcher(stack: ExitStack) -> None:
    """Host reads and kernel launches that the dispatch mode would not see."""
    stack.enter_context(_patched(torch.Tensor, "tolist", _refuse(
        "Tensor.tolist() copies tensor data to the host")))
    stack.enter_context(_patched(torch.Tensor, "numpy", _refuse(
        "Tensor.numpy() reads tensor data on the host")))
    if importlib.util.find_spec("triton") is None:
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    launch = _refuse("a Triton kernel launch bypasses the torch dispatcher, so the emulation "
                     "cannot record it (a launch is not a host sync, but it would be silently "
                     "missing from replay); under emulated capture kernels must take the torch "
                     "path (hip_kernels.capture.is_capturing())")
    stack.enter_context(_patched(InterpretedFunction, "run", launch))
    stack.enter_context(_patched(JITFunction, "run", launch))


class EmulatedGraph:
    """CPU counterpart of `torch.cuda.CUDAGraph`: capture_begin/capture_end, replay, reset, pool."""

    def __init__(self) -> None:
        self._ops: tuple[RecordedOp, ...] | None = None
        self._recording: list[RecordedOp] = []
        self._capture: ExitStack | None = None
        self._pool: EmulatedPool | None = None

    @property
    def ops(self) -> tuple[RecordedOp, ...]:
        if self._ops is None:
            raise RuntimeError("this graph has not been captured")
        return self._ops

    def pool(self) -> EmulatedPool:
        if self._pool is None:
            raise RuntimeError("this graph has not been captured")
        return self._pool

    def capture_begin(self, pool: EmulatedPool | None = None) -> None:
        global _active_graph
        if _active_graph is not None:
            raise GraphCaptureError("a graph capture is already running; captures do not nest")
        if self._ops is not None:
            raise RuntimeError("this graph is already captured; call reset() first")
        self._pool = pool if pool is not None else EmulatedPool()
        self._recording = []
        stack = ExitStack()
        try:
            _refuse_what_bypasses_the_dispatcher(stack)
            stack.enter_context(_Recorder(self._recording))
        except BaseException:
            stack.close()
            raise
        self._capture = stack
        _active_graph = self
        set_emulated_capture(True)

    def capture_end(self) -> None:
        self._ops = self._stop_recording()
        self._pool.graphs += 1
        self._pool.static_bytes += sum(t.untyped_storage().nbytes()
                                       for op in self._ops for t in op.static_outputs)
        logger.debug("emulated graph captured: %d ops, %d re-run at replay",
                     len(self._ops), sum(op.rerun for op in self._ops))

    def _stop_recording(self) -> tuple[RecordedOp, ...]:
        global _active_graph
        if _active_graph is not self:
            raise RuntimeError("capture_end() without capture_begin() on this graph")
        self._capture.close()
        self._capture = None
        _active_graph = None
        set_emulated_capture(False)
        ops, self._recording = tuple(self._recording), []
        return ops

    def replay(self) -> None:
        with torch.inference_mode():
            for op in self.ops:
                op.replay()

    def reset(self) -> None:
        self._ops = None


@contextmanager
def graph(g: EmulatedGraph, pool: EmulatedPool | None = None) -> Iterator[EmulatedGraph]:
    """Capture context, like `torch.cuda.graph(g, pool=pool)`. On error the graph stays empty."""
    g.capture_begin(pool=pool)
    try:
        yield g
    except BaseException:
        g._stop_recording()
        raise
    g.capture_end()
