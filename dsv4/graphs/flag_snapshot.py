"""Flags that change what a captured graph contains are read once, before capture; replaying
after one of them changed is an error, not a silent no-op."""

from __future__ import annotations

import os
from typing import Any, Iterable

from hip_kernels.flags import Flag


class GraphFlagChanged(RuntimeError):
    """A flag that shaped the captured graphs has a different value now."""


def _environment_value(flag: Flag) -> Any:
    """The flag's value as the environment says now (ignoring the flag's cached value)."""
    raw = os.environ.get(flag.name)
    return flag.default if raw is None else flag.parse(raw)


class FlagSnapshot:
    def __init__(self, flags: Iterable[Flag]) -> None:
        self._captured = [(flag, flag.get()) for flag in flags]

    def check(self) -> None:
        for flag, captured in self._captured:
            now = _environment_value(flag)
            if now != captured:
                raise GraphFlagChanged(
                    f"{flag.name} changed after graph capture (captured with {captured!r}, the "
                    f"environment now says {now!r}); the graphs still do the old thing: restore "
                    "the flag or capture again")
