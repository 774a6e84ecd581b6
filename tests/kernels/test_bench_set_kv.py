"""scripts/bench_set_kv.py --quick runs on this machine and writes the documented JSON."""

from bench_runner import quick_record, script_help

ROW_KEYS = {"op", "backend", "n", "p50_us", "p90_us", "min_us", "reps", "clock", "bytes",
            "gb_per_s", "hbm_fraction", "matches_torch"}
OPS = {"fused_k_norm_rope_store", "fused_store_cache", "fused_translate_norm_rope_store",
       "store_kv_pack", "indexer_store"}


def test_help():
    text = script_help("bench_set_kv.py")
    assert "--quick" in text and "--out" in text


def test_quick_run_writes_the_documented_json(tmp_path):
    record = quick_record("bench_set_kv.py", tmp_path / "bench.json")
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
