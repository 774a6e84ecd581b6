"""`python -m dsv4 generate` in a subprocess: the JSON report on the last line, eager and graphs."""

import json
import os
import subprocess
import sys

import pytest

KEYS = {"tokens_per_s", "step_latency_ms_p50", "step_latency_ms_p90", "swa_translations_per_step",
        "graph", "pool_usage"}


def generate(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    proc = subprocess.run([sys.executable, "-m", "dsv4", "generate", "--json", "--batch", "3",
                           "--prompt-len", "16", "--max-new-tokens", "5", *args],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    return lines[:-1], json.loads(lines[-1])


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_generate_reports_speed_translations_and_pool_usage(graph):
    text, r = generate("--graph" if graph else "--no-graph")
    assert KEYS <= set(r)
    assert r["graph"] is graph and r["decode_steps"] == 4
    assert 0 < r["step_latency_ms_p50"] <= r["step_latency_ms_p90"] and r["tokens_per_s"] > 0
    if graph:  # the gather runs inside the replayed graph, unseen by the pool's counters
        assert r["swa_translations_per_step"] is None
        assert any("n/a (graph replay" in line for line in text)
    else:      # one gather per step, every other layer hits the location cache
        assert r["swa_translations_per_step"] == 1.0
        assert r["swa_cache_hits_per_step"] == 3.0
    pool = r["pool_usage"]
    assert 0 < pool["full_tokens_peak"] <= pool["full_tokens"]
    assert any(line.startswith("decode step latency") for line in text)
