"""scripts/bench_gemm.py --quick runs on this machine and writes the documented JSON: every
quantized linear of the model beside its bf16 GEMM, per backend that runs here."""

from bench_runner import quick_record, script_help

ROW_KEYS = {"model", "layer", "op", "backend", "tokens", "rows", "k", "n", "experts", "p50_us",
            "p90_us", "min_us", "reps", "clock", "bytes", "gb_per_s", "hbm_fraction",
            "max_abs_diff"}
LAYERS = {"wq_a", "wq_b", "wkv", "wo_b", "shared_w1", "shared_w2", "experts_w1", "experts_w2"}


def test_help():
    text = script_help("bench_gemm.py")
    assert "--quick" in text and "--tokens" in text


def test_quick_run_writes_the_documented_json(tmp_path):
    record = quick_record("bench_gemm.py", tmp_path / "bench.json")
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
