"""What a GPU would launch, counted on a CPU with Triton's interpreter (TRITON_INTERPRET=1).

`GpuLaunches` is a TorchDispatchMode that counts, while in its ``with``:
- each Triton launch (a run of an interpreted kernel), by kernel name;
- each aten op run outside a Triton launch, by name, except views, allocations
  (`bench_common.NO_KERNEL_OPS`) and host reads (``_local_scalar_dense``, counted apart as
  ``host_reads``): one kernel each on a GPU. The interpreter's own copies inside a launch are
  not counted.
A `dsv4` op is not one launch here: its body runs under the mode, so a wrapper's torch prelude
counts op by op beside the Triton kernel it feeds, as a GPU would launch them. (The dispatcher-op
counter, `bench_common.count_dispatcher_ops`, counts the op once, whatever runs inside it.)
The body runs with the conjugate and negative view keys on: a mode's handler runs with them off
(handled above it), and a body run there reads a ``conj()`` view it makes unconjugated (the
inverse RoPE turns the wrong way), which is why a plain pass-through mode changes an engine's
tokens on a CPU and this one does not.

Counts go to the current scope (``"outside"`` unless inside ``with counter.scope(name)``), so a
caller can split a step per decoder layer. On a GPU, Triton launches do not pass through the
interpreter and would be missed: the mode refuses to start unless the interpreter is on (and
then every tensor is on the CPU, where a dsv4 op's body is its CPU kernel).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench_common import HOST_SYNC_OPS, NO_KERNEL_OPS

OUTSIDE = "outside"
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_VIEW_BITS = torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.Negative)


@dataclass
class Launches:
    """One scope's launches: Triton kernels and aten ops by name, and its host reads."""
    triton: Counter = field(default_factory=Counter)
    aten: Counter = field(default_factory=Counter)
    host_reads: int = 0

    @property
    def n_triton(self) -> int:
        return sum(self.triton.values())

    @property
    def n_aten(self) -> int:
        return sum(self.aten.values())

    @property
    def total(self) -> int:
        return self.n_triton + self.n_aten

    def summary(self) -> dict:
        return {"launches": self.total, "triton": self.n_triton, "aten": self.n_aten,
                "host_reads": self.host_reads,
                "triton_by_name": dict(sorted(self.triton.items())),
                "aten_by_name": dict(sorted(self.aten.items()))}


class GpuLaunches(TorchDispatchMode):
    """See the module docstring. ``scopes[name]`` is a `Launches`; ``total`` sums them."""

    def __init__(self) -> None:
        super().__init__()
        self.scopes: dict[str, Launches] = {}
        self.current = OUTSIDE
        self._in_kernel = False
        self._run = None

    @property
    def total(self) -> Launches:
        out = Launches()
        for s in self.scopes.values():
            out.triton.update(s.triton)
            out.aten.update(s.aten)
            out.host_reads += s.host_reads
        return out

    def _here(self) -> Launches:
        return self.scopes.setdefault(self.current, Launches())

    @contextlib.contextmanager
    def scope(self, name: str):
        """Count what runs inside the ``with`` under ``name`` (scopes nest; the innermost
        takes the count)."""
        outer, self.current = self.current, name
        try:
            yield self
        finally:
            self.current = outer

    def __enter__(self):
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("GpuLaunches counts interpreted Triton launches: set "
                               "TRITON_INTERPRET=1 before triton is imported")
        from triton.runtime.interpreter import InterpretedFunction

        self._run = run = InterpretedFunction.run

        def counted_run(fn, *args, warmup=False, **kwargs):
            if warmup:
                return run(fn, *args, warmup=warmup, **kwargs)
            self._here().triton[fn.__name__] += 1
            self._in_kernel = True
            try:
                return run(fn, *args, warmup=warmup, **kwargs)
            finally:
                self._in_kernel = False

        InterpretedFunction.run = counted_run
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        try:
            return super().__exit__(*exc)
        finally:
            InterpretedFunction.run = self._run

    @contextlib.contextmanager
    def _active(self):
        """This mode on again inside its own handler (the base class's enter, not ours: the
        Triton patch is in place already)."""
        TorchDispatchMode.__enter__(self)
        try:
            yield
        finally:
            TorchDispatchMode.__exit__(self, None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_kernel:
            return func(*args, **kwargs)
        if func.namespace == "dsv4":
            # Run the op's body (its CPU kernel) with this mode on, so its own ops count. A
            # handler runs with the conjugate/negative-view keys excluded (they were handled
            # above it); the body must not be, or a conj() view it makes is read unconjugated.
            exclude = torch._C._dispatch_tls_local_exclude_set() - _VIEW_BITS
            with self._active(), torch._C._ForceDispatchKeyGuard(
                    torch._C._dispatch_tls_local_include_set(), exclude):
                return func.redispatch(_CPU, *args, **kwargs)
        # Below autograd (in a dsv4 op's body) a composite op reaches the mode whole: decompose
        # it as the dispatcher would (`to` a copy or nothing, `square` a pow), counting its parts.
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE):
            with self._active():
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = func.overloadpacket.__name__
        if name in HOST_SYNC_OPS:
            self._here().host_reads += 1
        elif not func.is_view and name not in NO_KERNEL_OPS:
            self._here().aten[name] += 1
        return func(*args, **kwargs)
