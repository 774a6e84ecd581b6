"""The README's Python example runs as written: the block between its api-example markers is
executed here, so the README cannot drift from the API."""

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"<!-- api-example:begin -->\n```python\n(.*?)```\n<!-- api-example:end -->",
                   re.S)


def readme_example() -> str:
    found = BLOCK.findall(README.read_text())
    assert len(found) == 1, "README.md needs one ```python block between the api-example markers"
    return found[0]


@pytest.fixture
def two_threads():
    """Two threads while the example runs (the tests run on one), so that its own setting shows."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_readme_python_example_runs_and_prints_two_requests(flag_env, two_threads):
    code = readme_example()
    assert len(code.splitlines()) <= 12
    names = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README) + ":api-example", "exec"), names)
    out = names["out"]
    assert len(out.tokens) == 2 and out.errors == [None, None]
    assert all(1 <= len(t) <= 8 for t in out.tokens)
    assert printed.getvalue().strip() == f"{out.tokens} {out.errors}"
    assert torch.get_num_threads() == 1     # the example sets the CLI's CPU default
