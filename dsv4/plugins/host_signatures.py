"""Read a host engine's method signatures from its installed source, without importing it.

Importing SGLang's or vLLM's model modules takes seconds and pulls GPU-only dependencies; reading
the source file takes milliseconds and works on any machine. A plugin compares what it finds
here with the signatures it was written against before it replaces anything, and
`python -m dsv4 env` uses the same reading to show what a plugin would replace.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def module_source_path(module: str) -> str | None:
    """The file of `module` if it is installed (its parent packages are not executed)."""
    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], *parts[1:]) + ".py"
    return path if os.path.exists(path) else None


def class_methods(module: str, cls: str) -> dict[str, tuple[str, ...]] | None:
    """{method name: parameter names} of class `cls` in the installed `module`, or None when the
    module or the class is not there."""
    path = module_source_path(module)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {item.name: _parameter_names(item.args) for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return None


def _parameter_names(args: ast.arguments) -> tuple[str, ...]:
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return tuple(names)
