"""scripts/bench_gemm.py --quick runs on this machine and writes the documented JSON: every
quantized linear of the model beside its bf16 GEMM, per backend that runs here."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gemm.py"
ROW_KEYS = {"model", "layer", "op", "backend", "tokens", "rows", "k", "n", "experts", "p50_us",
            "p90_us", "min_us", "reps", "clock", "bytes", "gb_per_s", "hbm_fraction",
            "max_abs_diff"}
LAYERS = {"wq_a", "wq_b", "wkv", "wo_b", "shared_w1", "shared_w2", "experts_w1", "experts_w2"}


def run(*args, **env):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_help():
    out = run("--help")
    assert out.returncode == 0 and "--quick" in out.stdout and "--tokens" in out.stdout


def test_quick_run_writes_the_documented_json(tmp_path):
    out_file = tmp_path / "bench.json"
    proc = run("--quick", "--no-progress", "--out", str(out_file))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out_file.read_text())
    for key in ("benchmark", "schema_version", "created", "argv", "quick", "device", "env",
                "config", "peak_hbm_bytes_per_s", "skipped", "notes", "results"):
        assert key in record, key
    assert record["benchmark"] == "bench_gemm" and record["quick"] is True
    tokens = record["config"]["tokens"]
    rows = record["results"]
    for backend in ("torch", "bf16"):
        assert {(r["layer"], r["tokens"]) for r in rows if r["backend"] == backend} == {
            (layer, t) for layer in LAYERS for t in tokens}
    if record["device"] != "cuda":
        assert "triton" in record["skipped"] and record["peak_hbm_bytes_per_s"] is None
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["p50_us"] > 0 and r["bytes"] > 0 and r["gb_per_s"] > 0
        assert r["op"] == ("bf16" if r["backend"] == "bf16" else
                           "fp4_grouped_linear" if r["layer"].startswith("experts") else
                           "fp8_linear")
        assert (r["max_abs_diff"] is None) == (r["backend"] in ("torch", "bf16"))
        routed = r["layer"].startswith("experts")
        assert r["rows"] == r["tokens"] * (6 if routed else 1)
        assert (r["experts"] > 0) == routed
