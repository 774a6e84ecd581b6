"""The `dsv4` operator library: every kernel family defines its dispatcher ops here.

A family defines an op with its backends as data: `define_op(name, schema, ref, fake,
triton=..., hip=...)` makes one overload of `torch.ops.dsv4.<name>` per backend, named after it
(`.torch`, the reference; `.triton`; `.hip`), each registered with that backend's function
itself, so a call reaches its kernel without a dispatching frame of ours. The family's public
function checks its arguments, resolves the backend on the host (`backend.resolve`) and calls
`op(name, backend)` with the checked arguments.

Whatever backend runs it, a call is one dispatcher op: graph capture (a real one, or the CPU
emulation that records dispatcher ops) records it as one node, `torch.compile` sees one opaque op
(its fake implementation gives the output shapes), op counters count one `dsv4::<name>`. The
backend is the overload, and every other choice that changes the math (fp8 dialect, numerics)
is a plain argument, so a recorded call replays the same kernel.

A Triton or HIP implementation is named "module.function" (a module of this package) and
imported the first time `op` is asked for its overload: `import hip_kernels` never imports
triton or builds an extension.
"""

from __future__ import annotations

import importlib
import threading
from typing import Callable

import torch

NAME = "dsv4"
_LIBRARY = torch.library.Library(NAME, "DEF")
ops = getattr(torch.ops, NAME)
_PENDING: dict[str, str] = {}       # "name.backend" -> "module.function", not yet registered
_LOCK = threading.Lock()


def _define(qualified: str, schema: str, fake: Callable) -> None:
    _LIBRARY.define(f"{qualified}{schema}")
    _LIBRARY.impl(qualified, fake, "Meta")


def define_op(name: str, schema: str, ref: Callable, fake: Callable, *,
              triton: str | None = None, hip: str | None = None) -> None:
    """Define `torch.ops.dsv4.<name>`. schema: "(args) -> returns" in the dispatcher's schema
    language; ref: the torch reference, a function of the schema's arguments (any device,
    CompositeExplicitAutograd); fake (Meta): empty outputs of the right shapes, or None for an
    op that only writes its mutated arguments; triton, hip: "module.function" of this package,
    the backend's function of the same arguments. With neither, the op has one body, `ref`, and
    no backends (`torch.ops.dsv4.<name>` itself); else one overload per backend given."""
    if triton is None and hip is None:
        _define(name, schema, fake)
        _LIBRARY.impl(name, ref, "CompositeExplicitAutograd")
        return
    _define(f"{name}.torch", schema, fake)
    _LIBRARY.impl(f"{name}.torch", ref, "CompositeExplicitAutograd")
    for backend, where in (("triton", triton), ("hip", hip)):
        if where is not None:
            _define(f"{name}.{backend}", schema, fake)
            _PENDING[f"{name}.{backend}"] = where


def op(name: str, backend: str) -> torch._ops.OpOverload:
    """The overload of `torch.ops.dsv4.<name>` that runs `backend` (torch|triton|hip), its
    implementation imported and registered on first use."""
    qualified = f"{name}.{backend}"
    if qualified in _PENDING:
        with _LOCK:                     # another thread may be registering it: wait for it
            where = _PENDING.get(qualified)
            if where is not None:
                module, function = where.rsplit(".", 1)
                impl = getattr(importlib.import_module(f"{__package__}.{module}"), function)
                _LIBRARY.impl(qualified, impl, "CompositeExplicitAutograd")
                del _PENDING[qualified]
    return getattr(getattr(ops, name), backend)
