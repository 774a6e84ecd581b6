"""What a call dispatches: every top-level dispatcher op it runs, in order (one launch each on a
GPU), recorded with a TorchDispatchMode."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((f"{func.namespace}::{func.overloadpacket.__name__}", args))
        return func(*args, **(kwargs or {}))


def recorded_calls(fn) -> list:
    """(op name, args) of every dispatcher op fn() runs."""
    mode = _Record()
    with mode:
        fn()
    return mode.calls


def op_names(fn) -> list[str]:
    """The names ("namespace::op") of the dispatcher ops fn() runs."""
    return [name for name, _ in recorded_calls(fn)]
