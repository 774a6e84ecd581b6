"""Declaration and parsing of the ``DSV4_*`` environment flags.

Each package declares its flags in its own ``envs.py`` with :func:`declare`. A flag's value is
read from the environment on first use and cached; :func:`refresh` forgets the cached values
(tests use it after changing ``os.environ``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
BOOL_VALUES = "0/1/true/false/on/off"


class FlagError(ValueError):
    """A flag's environment value cannot be parsed."""


def _parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise FlagError(f"{name}={raw!r}: expected one of {BOOL_VALUES}")


@dataclass
class Flag:
    name: str
    type: str  # "bool" | "choice" | "int" | "str"
    default: Any
    help: str
    package: str
    choices: tuple[str, ...] = ()
    _cache: Any = field(default=None, repr=False)
    _cached: bool = field(default=False, repr=False)

    def parse(self, raw: str) -> Any:
        if self.type == "bool":
            return _parse_bool(self.name, raw)
        if self.type == "choice":
            v = raw.strip().lower()
            if v not in self.choices:
                raise FlagError(f"{self.name}={raw!r}: expected one of {'|'.join(self.choices)}")
            return v
        if self.type == "int":
            try:
                return int(raw)
            except ValueError:
                raise FlagError(f"{self.name}={raw!r}: expected an integer") from None
        return raw

    @property
    def source(self) -> str:
        return "env" if self.name in os.environ else "default"

    def get(self) -> Any:
        if not self._cached:
            raw = os.environ.get(self.name)
            self._cache = self.default if raw is None else self.parse(raw)
            self._cached = True
        return self._cache

    def __call__(self) -> Any:
        return self.get()

    def default_text(self) -> str:
        if self.type == "bool":
            return "1" if self.default else "0"
        return str(self.default)

    def type_text(self) -> str:
        if self.type == "bool":
            return "bool"
        if self.type == "choice":
            return " \\| ".join(self.choices)
        return self.type


_REGISTRY: dict[str, Flag] = {}


def declare(name: str, type: str, default: Any, help: str, package: str,
            choices: tuple[str, ...] = ()) -> Flag:
    if not name.startswith("DSV4_"):
        raise ValueError(f"flag name {name!r} must start with DSV4_")
    if type not in ("bool", "choice", "int", "str"):
        raise ValueError(f"flag {name}: type must be bool|choice|int|str, got {type!r}")
    if type == "choice" and default not in choices:
        raise ValueError(f"flag {name}: default {default!r} not in {choices}")
    if name in _REGISTRY:
        return _REGISTRY[name]
    flag = Flag(name, type, default, help, package, tuple(choices))
    _REGISTRY[name] = flag
    return flag


def all_flags() -> list[Flag]:
    """Every declared flag (import the packages' envs modules first)."""
    return sorted(_REGISTRY.values(), key=lambda f: (f.package, f.name))


# Bumped by refresh(): a reader that remembers flag values may reuse them while it is unchanged.
EPOCH = 0


def refresh() -> None:
    """Forget cached values so the next read sees the current environment."""
    global EPOCH
    EPOCH += 1
    for f in _REGISTRY.values():
        f._cached = False
        f._cache = None


def markdown_table(flags: list[Flag]) -> str:
    lines = ["| flag | package | type | default | meaning |", "|---|---|---|---|---|"]
    for f in flags:
        lines.append(f"| `{f.name}` | {f.package} | {f.type_text()} | `{f.default_text()}` | {f.help} |")
    return "\n".join(lines)


def bool_flag(name: str, default: bool, help: str, package: str) -> Flag:
    return declare(name, "bool", default, help, package)


def choice_flag(name: str, choices: tuple[str, ...], default: str, help: str, package: str) -> Flag:
    return declare(name, "choice", default, help, package, choices)


def int_flag(name: str, default: int, help: str, package: str) -> Flag:
    return declare(name, "int", default, help, package)


def str_flag(name: str, default: str, help: str, package: str) -> Flag:
    return declare(name, "str", default, help, package)
