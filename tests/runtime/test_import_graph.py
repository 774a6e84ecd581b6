"""No import circle in hip_kernels, mem_pool or dsv4, and no import below a module's floor, counting
the imports inside functions too.

A circle works only as long as each side imports the other late enough; one moved import line
turns it into an ImportError or a half-initialized module, so none is allowed. The graph is built
from the source with `ast`: every `import` and `from ... import` statement, relative ones
resolved, with an edge to a submodule when the imported name is one (`from . import envs`) and
to the package itself otherwise (`from hip_kernels import StoreNumerics`), and an edge to each
backend module a `define_op(..., triton="module.function", hip=...)` names (imported by the
library when the op first runs on that backend).

Floors: hip_kernels knows nothing of mem_pool or dsv4, mem_pool nothing of dsv4, and dsv4's
checkpoint I/O (weights/) and tensor parallelism (parallel/) sit below the model: of dsv4 they
import only parallel/ (weights/ sits on it) and the leaves config and envs, so whatever builds a
DeepseekV4Model (dsv4.model, dsv4.checkpoint, dsv4.random_init) lives above them.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hip_kernels", "mem_pool", "dsv4")


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of PACKAGES."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _known(name: str, modules) -> str | None:
    """name if it is a module of ours, else its longest prefix that is, else None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def backend_modules(call: ast.Call, package: str) -> list[str]:
    """The modules a define_op call names as its backends' ("module.function", or an f-string
    that starts with "module.")."""
    func = call.func
    if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) != "define_op":
        return []
    found = []
    for keyword in call.keywords:
        value = keyword.value
        if isinstance(value, ast.IfExp):                  # hip=f"..." if ... else None
            value = value.body
        if isinstance(value, ast.JoinedStr) and value.values:
            value = value.values[0]
        if keyword.arg in ("triton", "hip") and isinstance(value, ast.Constant) \
                and isinstance(value.value, str):
            found.append(f"{package}.{value.value.split('.')[0]}")
    return found


def imports_of(name: str, path: Path, modules, source: str | None = None) -> set[str]:
    """The modules of ours that `name` (at `path`, its text `source` unless given) imports
    anywhere in its body: at the top, inside functions, classes and conditionals alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    text = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(text, str(path))):
        targets = []
        if isinstance(node, ast.Call):
            targets = backend_modules(node, package)
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules
                       else origin for alias in node.names]
        for target in targets:
            known = _known(target, modules)
            if known is not None and known != name:
                found.add(known)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_finder_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_graph_resolves_relative_and_function_level_imports():
    graph = import_graph()
    assert "hip_kernels.kv_layout" in graph["hip_kernels.set_kv"]
    assert "hip_kernels.mhc_split_triton" in graph["hip_kernels.triton_aot"]  # inside a function
    assert "hip_kernels.mhc_split_triton" in graph["hip_kernels.mhc_split"]   # a backend named
    assert {"hip_kernels.set_kv_triton", "hip_kernels.set_kv_hip"} <= graph["hip_kernels.set_kv"]
    assert "hip_kernels" in graph["mem_pool.dsv4_pool"]


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# (modules under this prefix, what they must not import (those modules and everything under them),
# the exceptions to that). dsv4.config and dsv4.envs are leaves: they import nothing of dsv4.
LEAVES = ("dsv4.config", "dsv4.envs")
FLOORS = (
    ("hip_kernels", ("mem_pool", "dsv4"), ()),
    ("mem_pool", ("dsv4",), ()),
    ("dsv4.parallel", ("dsv4",), ("dsv4.parallel", *LEAVES)),
    ("dsv4.weights", ("dsv4",), ("dsv4.weights", "dsv4.parallel", *LEAVES)),
)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """'module -> import' for every import below the importing module's floor."""
    return sorted(f"{module} -> {target}"
                  for module, targets in graph.items()
                  for prefix, above, allowed in FLOORS if _under(module, prefix)
                  for target in targets
                  if any(_under(target, a) for a in above)
                  and not any(_under(target, a) for a in allowed))


def test_floor_check_sees_an_import_inside_a_function():
    modules = module_files()
    lazy = "def build():\n    from ..model import DeepseekV4Model\n    return DeepseekV4Model\n"
    fake = ROOT / "dsv4" / "weights" / "lazy.py"
    graph = {"dsv4.weights.lazy": imports_of("dsv4.weights.lazy", fake, modules, lazy)}
    assert graph["dsv4.weights.lazy"] == {"dsv4.model"}
    assert floor_violations(graph) == ["dsv4.weights.lazy -> dsv4.model"]
    assert floor_violations({
        "mem_pool.x": {"hip_kernels", "dsv4.envs"}, "hip_kernels.y": {"mem_pool"},
        "dsv4.parallel.z": {"dsv4.checkpoint", "dsv4.config", "dsv4.weights.quant"},
        "dsv4.weights.w": {"dsv4", "dsv4.parallel.split", "dsv4.random_init", "dsv4.envs"},
        "dsv4.model": {"dsv4.weights", "dsv4.parallel"}}) == [
        "dsv4.parallel.z -> dsv4.checkpoint", "dsv4.parallel.z -> dsv4.weights.quant",
        "dsv4.weights.w -> dsv4", "dsv4.weights.w -> dsv4.random_init",
        "hip_kernels.y -> mem_pool", "mem_pool.x -> dsv4.envs"]


def test_no_module_imports_one_above_its_floor():
    graph = import_graph()
    for leaf in LEAVES:   # what weights/ and parallel/ may import must stay below them
        assert not [t for t in graph[leaf] if _under(t, "dsv4")], leaf
    violations = floor_violations(graph)
    assert not violations, "imports above the floor:\n" + "\n".join(violations)


# Host engines and optional GPU libraries: imported inside functions only, so `import dsv4` (and
# any module of ours) works where they are not installed.
OPTIONAL = ("sglang", "vllm", "aiter")


def top_level_optional_imports(path: Path, source: str | None = None) -> list[str]:
    """'line: module' for each import of an OPTIONAL package in the module's own body (top-level
    statements, including those inside a top-level if / try / with), not inside a function."""
    text = path.read_text() if source is None else source
    found, pending = [], list(ast.parse(text, str(path)).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[0] in OPTIONAL]
        for field in ("body", "orelse", "finalbody", "handlers"):
            pending += getattr(node, field, [])
    return sorted(found)


def test_optional_import_check_sees_a_top_level_import():
    src = ("import torch\nfrom sglang.srt import x\ntry:\n    import aiter\nexcept ImportError:\n"
           "    pass\ndef f():\n    import vllm\n")
    assert top_level_optional_imports(Path("m.py"), src) == ["2: sglang.srt", "4: aiter"]


def test_no_module_imports_a_host_engine_or_aiter_at_its_top():
    found = {name: top_level_optional_imports(path) for name, path in module_files().items()}
    assert {name: lines for name, lines in found.items() if lines} == {}
