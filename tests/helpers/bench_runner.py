"""Running a benchmark script as a user would (a subprocess) and checking the record every
script writes (scripts/bench_common.py's keys); a script's --help in this process."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import bench_common as bc  # noqa: E402


def run_script(name: str, *args: str, timeout: int = 300, **env: str
               ) -> subprocess.CompletedProcess:
    """scripts/<name> with args, in a fresh process (env: extra environment variables)."""
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})


def script_help(name: str) -> str:
    """The text `scripts/<name> --help` prints, through the script's main in this process
    (argparse prints it and exits with status 0). A process of its own would spend 2 s of CPU
    importing torch again for it; each benchmark's --quick test starts its script as a user
    does."""
    main = importlib.import_module(name.removesuffix(".py")).main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(["--help"])
        except SystemExit as e:
            assert e.code == 0, (name, e.code)
        else:
            raise AssertionError(f"{name} --help did not exit")
    return out.getvalue()


def check_record(record: dict, benchmark: str) -> None:
    """The keys every benchmark's JSON record holds, for a --quick run of `benchmark`."""
    for key in bc.RECORD_KEYS:
        assert key in record, key
    assert record["benchmark"] == benchmark and record["quick"] is True
    assert set(bc.ENV_KEYS) <= record["env"].keys()
    assert record["env"]["torch"] == torch.__version__


def quick_record(name: str, out: Path, *args: str, **env: str) -> dict:
    """Run scripts/<name> --quick (no progress bars) writing to `out`, which it names on stdout;
    its checked record."""
    proc = run_script(name, "--quick", "--no-progress", "--out", str(out), *args, **env)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout, proc.stdout
    record = json.loads(out.read_text())
    check_record(record, name.removesuffix(".py"))
    return record
