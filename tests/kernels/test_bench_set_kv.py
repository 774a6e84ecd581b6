"""scripts/bench_set_kv.py --quick runs on this machine and writes the documented JSON."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_set_kv.py"
ROW_KEYS = {"op", "backend", "n", "p50_us", "p90_us", "min_us", "reps", "clock", "bytes",
            "gb_per_s", "hbm_fraction", "matches_torch"}
OPS = {"fused_k_norm_rope_store", "fused_store_cache", "fused_translate_norm_rope_store",
       "store_kv_pack", "indexer_store"}


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_help():
    out = run("--help")
    assert out.returncode == 0 and "--quick" in out.stdout and "--out" in out.stdout


def test_quick_run_writes_the_documented_json(tmp_path):
    out_file = tmp_path / "bench.json"
    proc = run("--quick", "--no-progress", "--out", str(out_file))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out_file.read_text())
    for key in ("benchmark", "schema_version", "created", "argv", "quick", "device", "env",
                "config", "peak_hbm_bytes_per_s", "skipped", "notes", "results"):
        assert key in record, key
    assert record["benchmark"] == "bench_set_kv" and record["quick"] is True
    gpu = record["device"] == "cuda"
    if not gpu:
        assert {"triton", "hip"} <= record["skipped"].keys()
        assert record["peak_hbm_bytes_per_s"] is None
    ran = {(r["op"], r["backend"], r["n"]) for r in record["results"]}
    assert {(op, "torch", n) for op in OPS for n in (1, 8, 64, 256)} <= ran
    for r in record["results"]:
        assert set(r) == ROW_KEYS
        assert r["p50_us"] > 0 and r["bytes"] > 0 and r["gb_per_s"] > 0
        assert r["matches_torch"] is (None if r["backend"] == "torch" else True), r
        assert (r["hbm_fraction"] is None) == (record["peak_hbm_bytes_per_s"] is None)
    assert "wrote" in proc.stdout
