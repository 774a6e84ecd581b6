"""The packages import on a machine without triton and keep their layering."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCK_TRITON = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed (blocked by the test)")
        return None
sys.meta_path.insert(0, _NoTriton())
"""


def test_packages_import_without_triton():
    code = BLOCK_TRITON + """
import dsv4, mem_pool, hip_kernels
import dsv4.cli, dsv4.flags_table
assert "triton" not in sys.modules
try:
    import triton  # noqa
except ImportError:
    pass
else:
    raise SystemExit("triton import was not blocked")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_layering_import_direction():
    forbidden = {"hip_kernels": {"mem_pool", "dsv4"}, "mem_pool": {"dsv4"}}
    for pkg, bad in forbidden.items():
        for f in (ROOT / pkg).rglob("*.py"):
            hit = _imports(f) & bad
            assert not hit, f"{f.relative_to(ROOT)} imports {hit}: breaks the layering"


def test_library_code_does_not_print():
    for pkg in ("hip_kernels", "mem_pool", "dsv4"):
        for f in (ROOT / pkg).rglob("*.py"):
            if f.name.startswith("cli") or f.name == "__main__.py":  # the command line prints
                continue
            tree = ast.parse(f.read_text())
            calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Name) and n.func.id == "print"]
            assert not calls, f"{f.relative_to(ROOT)} prints; use the package logger"
