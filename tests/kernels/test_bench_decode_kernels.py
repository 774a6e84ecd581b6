"""scripts/bench_decode_kernels.py --quick runs on this machine and writes the documented JSON;
with the interpreter asked for, the Triton rows are checked against the torch backend."""

from bench_runner import quick_record, script_help

ROW_KEYS = {"op", "numerics", "backend", "batch", "p50_us", "p90_us", "min_us", "reps", "clock",
            "bytes", "gb_per_s", "hbm_fraction", "max_abs_diff"}
CASES = {("sparse_decode_attention", "reference"), ("sparse_decode_attention", "fp32"),
         ("indexer_scores", "reference")}


def test_help():
    text = script_help("bench_decode_kernels.py")
    assert "--quick" in text and "--batches" in text


def test_quick_run_writes_the_documented_json(tmp_path):
    record = quick_record("bench_decode_kernels.py", tmp_path / "bench.json")
    batches = record["config"]["batches"]
    ran = {(r["op"], r["numerics"], r["backend"], r["batch"]) for r in record["results"]}
    assert {(op, mode, "torch", b) for op, mode in CASES for b in batches} <= ran
    if record["device"] != "cuda":
        assert "triton" in record["skipped"] and record["peak_hbm_bytes_per_s"] is None
    for r in record["results"]:
        assert set(r) == ROW_KEYS
        assert r["p50_us"] > 0 and r["bytes"] > 0 and r["gb_per_s"] > 0
        assert (r["max_abs_diff"] is None) == (r["backend"] == "torch")


def test_interpreted_triton_rows_match_torch(tmp_path):
    """Asked for on a CPU, Triton runs interpreted (a note says its times mean nothing) and its
    outputs stay within the kernels' stated tolerances of the torch backend's."""
    record = quick_record("bench_decode_kernels.py", tmp_path / "bench.json", "--backends",
                          "torch,triton", "--batches", "1", "--heads", "4", "--comp", "8",
                          "--index-heads", "8", "--index-rows", "16", TRITON_INTERPRET="1")
    triton = [r for r in record["results"] if r["backend"] == "triton"]
    assert {(r["op"], r["numerics"]) for r in triton} == CASES
    if record["device"] != "cuda":
        assert any("interpreter" in note for note in record["notes"])
    for r in triton:
        # bf16 outputs of magnitude ~1-4: a few bf16 ulps at most
        assert 0 <= r["max_abs_diff"] < 0.05, r
