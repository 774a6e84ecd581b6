"""What a call dispatches: every top-level dispatcher op it runs, in order (one launch each on a
GPU), recorded with a TorchDispatchMode. A `dsv4` op's overload is the backend that ran it
(torch | triton | hip, see `hip_kernels.library`)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.namespace}::{func.overloadpacket.__name__}"
        self.ops.append((name, func._overloadname, args))
        return func(*args, **(kwargs or {}))


def recorded_ops(fn) -> list:
    """(op name, overload name, args) of every dispatcher op fn() runs."""
    mode = _Record()
    with mode:
        fn()
    return mode.ops


def recorded_calls(fn) -> list:
    """(op name, args) of every dispatcher op fn() runs."""
    return [(name, args) for name, _, args in recorded_ops(fn)]


def op_names(fn) -> list[str]:
    """The names ("namespace::op") of the dispatcher ops fn() runs."""
    return [name for name, _, _ in recorded_ops(fn)]


def backends(fn, op: str | None = None) -> list[str]:
    """The backend of every dsv4 op (or only of `op`, "dsv4::<name>") fn() runs, in order."""
    return [overload for name, overload, _ in recorded_ops(fn)
            if name.startswith("dsv4::") and op in (None, name)]
