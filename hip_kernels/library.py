"""The `dsv4` operator library: every kernel family defines its dispatcher ops here.

An op is one call to the dispatcher whatever backend runs it: graph capture (a real one, or the
CPU emulation that records dispatcher ops) records it as one node, `torch.compile` sees one
opaque op (its fake implementation gives the output shapes), and op counters count one. An op
takes already checked arguments (each family's public function checks them and resolves the
backend on the host first) and every choice that changes its math (backend name, fp8 dialect,
numerics) as a plain argument, so a recorded call replays the same kernel.
"""

from __future__ import annotations

from typing import Callable

import torch

NAME = "dsv4"
_LIBRARY = torch.library.Library(NAME, "DEF")
ops = getattr(torch.ops, NAME)


def define_op(name: str, schema: str, impl: Callable, fake: Callable) -> None:
    """Define `torch.ops.dsv4.<name>`: schema is "(args) -> returns" in the dispatcher's schema
    language; impl runs it on any device (CompositeExplicitAutograd); fake (Meta) returns empty
    outputs of the right shapes, or None for an op that only writes its mutated arguments."""
    _LIBRARY.define(f"{name}{schema}")
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    _LIBRARY.impl(name, fake, "Meta")
