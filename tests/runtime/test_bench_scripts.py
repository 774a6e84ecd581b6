"""The benchmark scripts: bench_common's timing and launch counting, bench_swa_translation and
bench_decode in --quick mode (subprocesses writing the documented JSON), the summary of a
fabricated results directory, optional plots, and the sweep script's syntax and dry run."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench_runner import SCRIPTS, check_record, run_script, script_help

import bench_common as bc  # noqa: E402  (scripts/ is on the path through bench_runner)
import plot_results  # noqa: E402
import summarize_results  # noqa: E402

SWA_ROW_KEYS = {"model", "n_layers", "batch", "mode", "method", "us_per_step_p50",
                "us_per_step_p90", "us_per_layer", "launches_per_step", "host_syncs_per_step",
                "translations_per_step", "launches_by_name"}
DECODE_ROW_KEYS = {"config", "env", "concurrency", "context_len", "new_tokens", "decode_steps",
                   "itl_ms_p50", "itl_ms_p90", "itl_ms_mean", "prefill_ms", "decode_tokens_per_s",
                   "e2e_tokens_per_s", "swa_translations_per_step", "swa_cache_hits_per_step",
                   "graph_used", "flags", "itl_p50_vs_default", "step_ops", "step_syncs",
                   "step_device_syncs", "forward_ops", "forward_syncs", "forward_ops_per_layer",
                   "layer_ops", "layer_ops_max"}


# ---- bench_common ---------------------------------------------------------------------------


def test_percentiles_are_nearest_rank():
    t = bc.Timing([float(v) for v in range(10, 0, -1)], "perf_counter")
    assert (t.p50, t.p90) == (5.0, 9.0)
    assert bc.Timing([3.0], "perf_counter").summary()["p90_us"] == 3.0


def test_time_op_runs_warmup_then_reps():
    calls = []
    timing = bc.time_op(lambda: calls.append(1), warmup=3, reps=4)
    assert len(calls) == 7 and len(timing.samples_us) == 4
    assert timing.clock == ("cuda_event" if torch.cuda.is_available() else "perf_counter")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU proxy counter")
def test_cpu_launch_counter_counts_data_work_and_host_syncs():
    x = torch.arange(12)

    def ops():
        x.view(3, 4).t()               # views: no kernel
        torch.empty(5)                 # allocation: no kernel
        y = x * 2                      # one kernel
        y.reshape(4, 3).t().contiguous()  # one copy
        int(y.max())                   # a reduction and a host sync
        x.tolist()                     # a host sync the profiler would not see

    count = bc.count_launches(ops)
    assert count.counter == "cpu_aten_ops"
    assert count.by_name == {"aten::mul": 1, "aten::clone": 1, "aten::max": 1}
    assert (count.launches, count.host_syncs) == (3, 2)
    assert torch.Tensor.tolist.__qualname__ == "TensorBase.tolist"  # restored


def test_cpu_counter_tells_reads_of_device_data_from_host_bookkeeping():
    """Given the tensors a GPU run keeps on the device, a host read counts as a device sync
    when the data read was computed from one of them (through any chain of ops, views and
    in-place writes), not when it is the host's own bookkeeping."""
    weights, host = torch.arange(6.0), torch.arange(4)

    def ops():
        int(host.sum())                          # bookkeeping
        host.tolist()                            # bookkeeping
        logits = (weights * 2).view(2, 3)
        logits.argmax(-1).tolist()               # a device read
        buf = torch.zeros(3)
        buf.copy_(logits[0])                     # device data lands in a fresh tensor
        float(buf[1])                            # a device read

    count = bc.count_launches(ops, [weights])
    assert (count.host_syncs, count.device_syncs) == (4, 2)
    assert bc.count_launches(ops).device_syncs is None


@pytest.mark.gpu
def test_device_launch_counter_sees_kernels_and_device_to_host_copies():
    x = torch.arange(12, device="cuda")
    count = bc.count_launches(lambda: (x * 2, int(x.sum())))
    assert count.counter == "device_kernels"
    assert count.launches >= 2 and count.host_syncs == 1, count.by_name


def test_environment_has_the_documented_keys():
    env = bc.environment()
    assert list(env) == list(bc.ENV_KEYS)
    assert "DSV4_CACHE_SWA_TRANSLATION" in env["flags"]
    json.dumps(env)


# ---- the benchmark scripts ------------------------------------------------------------------


def test_every_script_has_help():
    """The benchmarks' help in this process (their --quick tests start them as a user does);
    the two scripts no other test starts, and which import no torch, as a user does."""
    names = ("bench_swa_translation.py", "bench_decode.py", "bench_prefix_cache.py",
             "bench_graph_replay.py", "bench_long_context.py")
    for name in names:
        text = script_help(name)
        assert "usage" in text and "--quick" in text and "--out" in text, name
    for name in ("plot_results.py", "summarize_results.py"):
        proc = subprocess.run([sys.executable, str(SCRIPTS / name), "--help"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (name, proc.stderr)
        assert "usage" in proc.stdout, name


@pytest.mark.slow
def test_swa_translation_quick_writes_the_documented_json(tmp_path):
    out = tmp_path / "swa.json"
    # Flash's 43 layers only: Pro's 61 run the same code for 18 more layers (half the time)
    proc = run_script("bench_swa_translation.py", "--quick", "--models", "flash",
                      "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    check_record(record, "bench_swa_translation")
    assert record["launch_counter"] == ("device_kernels" if torch.cuda.is_available()
                                        else "cpu_aten_ops")
    assert record["anchor_us_per_layer"] == 8.0
    rows = record["results"]
    assert {(r["n_layers"], r["batch"], r["mode"], r["method"]) for r in rows} == {
        (43, b, mode, m) for b in (1, 8) for mode in ("eager", "graph")
        for m in ("per_layer", "start_layer", "identity_cache", "fused_translate",
                  "fused_precomputed")}
    gathers = {"per_layer": None, "start_layer": 1, "identity_cache": 1, "fused_translate": 0,
               "fused_precomputed": 0}
    for r in rows:
        assert set(r) == SWA_ROW_KEYS
        assert r["us_per_step_p50"] > 0 and r["launches_per_step"] > 0
        want = r["n_layers"] if gathers[r["method"]] is None else gathers[r["method"]]
        assert r["translations_per_step"] == want, r
        if r["mode"] == "graph":
            assert r["host_syncs_per_step"] == 0, r  # value checks are skipped in capture
    for d in record["derived"]:
        # the cache saves (n_layers - 1) translations of at least one launch each
        assert d["launches_saved_per_step"] >= d["n_layers"] - 1
        for key in ("translate_us_per_layer", "cache_saving_us_per_step",
                    "start_layer_minus_cache_us_per_step", "fused_marginal_us_per_step",
                    "fused_marginal_us_per_layer", "fused_marginal_launches_per_step"):
            assert key in d
    hit = record["hit_cost"]
    # measured times only: which path is faster is the benchmark's report, not a test's
    assert 0 < hit["start_layer_hit_us"] and 0 < hit["identity_cache_hit_us"]
    assert 0 < hit["identity_keyed_hit_us"]


@pytest.mark.slow
def test_engine_bookkeeping_per_step_does_not_grow_with_context(tmp_path):
    """One location element per request and step for the allocation (last_loc and length);
    nothing proportional to the context (the engine keeps host block tables and frees an SWA
    page when it leaves the window, instead of rescanning the request each step)."""
    out = tmp_path / "book.json"
    proc = run_script("bench_engine_bookkeeping.py", "--quick", "--no-progress", "--out",
                      str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    check_record(record, "bench_engine_bookkeeping")
    assert [r["context_len"] for r in record["results"]] == [256, 1024]
    for r in record["results"]:
        assert r["steps"] == 22 and r["bookkeeping_us_p50"] > 0
        assert r["elements_per_step"] == 2.0
    assert record["ratios"]["elements"] == 1.0


def test_graph_replay_splits_its_cost_into_shapes_and_mechanism(tmp_path):
    out = tmp_path / "replay.json"
    proc = run_script("bench_graph_replay.py", "--quick", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    check_record(record, "bench_graph_replay")
    r = record["results"]
    assert r["eager_ms"] > 0 and r["replay_ms"] > 0 and r["replayed_ops"] <= r["recorded_ops"]
    # a graph's static shapes pool every row and attend over max_context_len / ratio rows
    assert r["eager_static_ops"] > r["eager_ops"]
    ratios = r["ratios"]
    assert ratios["replay_vs_eager"] == pytest.approx(
        ratios["static_shapes"] * ratios["mechanism"], rel=0.01)


@pytest.mark.slow
def test_prefix_cache_bench_reports_hits_and_same_tokens(tmp_path):
    """Prompts of 256 tokens, pages of 128: sharing the whole prompt hits one page (the last
    token is always computed), half the prompt, and gives the same first token. The times are
    reported, never compared: this machine is shared, and a timed assertion fails at random."""
    out = tmp_path / "bench_prefix_cache.json"
    proc = run_script("bench_prefix_cache.py", "--quick", "--no-progress", "--fractions",
                      "0,1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    check_record(record, "bench_prefix_cache")
    assert record["config"]["repetitions"] == 1  # --quick's documented default
    none, whole = record["results"]
    assert (none["hit_rate"], none["hit_tokens"]) == (0, 0)
    assert (whole["hit_rate"], whole["hit_tokens"], whole["prompt_tokens"]) == (0.5, 128, 256)
    assert none["same_tokens"] and whole["same_tokens"]
    assert whole["prefill_ms_cached"] > 0 and whole["prefill_ms_uncached"] > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert [p.name for p in plot_results.plot_all(tmp_path)] == ["prefix_cache.png"]


@pytest.mark.slow
def test_decode_quick_writes_the_documented_json(tmp_path):
    out = tmp_path / "decode.json"
    proc = run_script("bench_decode.py", "--quick", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    check_record(record, "bench_decode")
    assert record["errors"] == []
    assert record["model"]["preset"] == "tiny" and record["model"]["reduced"] is False
    assert record["model"]["weights"] == "bf16"      # tiny is too narrow for 128-wide blocks
    assert [r["weights"] for r in record["weight_reads"]] == ["bf16"]
    names = [c["name"] for c in record["configs"]]
    assert names == ["default", "DSV4_GRAPH=0", "DSV4_CACHE_SWA_TRANSLATION=0",
                     "DSV4_MULTI_STREAM_PREPARE=1"]
    rows = record["results"]
    assert {(r["config"], r["concurrency"], r["context_len"]) for r in rows} == {
        (n, c, 32) for n in names for c in (1, 4)}
    for r in rows:
        assert set(r) == DECODE_ROW_KEYS
        assert r["decode_steps"] == r["new_tokens"] - 1 == 8
        assert 0 < r["itl_ms_p50"] <= r["itl_ms_p90"]
        assert r["decode_tokens_per_s"] > 0 and r["itl_p50_vs_default"] > 0
        for flag, value in r["env"].items():  # the worker saw the configuration's flags
            assert r["flags"][flag] == {"value": value, "source": "env"}
        if not r["graph_used"]:
            # the model asks the pool once per step (for all layers), cache or no cache
            assert r["swa_translations_per_step"] == 1, r
            assert 0 < r["forward_ops"] < r["step_ops"], r
            assert 0 <= r["forward_syncs"] <= r["step_syncs"], r
            # the model forward reads nothing on the host; the step reads the sampled tokens
            assert r["forward_syncs"] == 0 and r["step_device_syncs"] == 1, r
            assert len(r["layer_ops"]) == 4 and max(r["layer_ops"]) == r["layer_ops_max"], r
            assert sum(r["layer_ops"]) < r["forward_ops"] == round(
                4 * r["forward_ops_per_layer"]), r
        else:
            assert r["step_ops"] is None and r["forward_syncs"] is None


WEIGHT_READ_KEYS = {"weights", "concurrency", "context_len", "bytes_read", "native_active_bytes",
                    "read_vs_native_active", "kv_read_bytes", "kv_written_bytes", "floor_ms",
                    "itl_vs_floor"}


@pytest.mark.slow
def test_decode_counts_the_weight_bytes_a_step_reads(tmp_path):
    """The small preset (the smallest that computes natively): one eager decode step with native
    weights reads within 15% of the step's native active bytes; with bf16 weights, more."""
    out = tmp_path / "decode.json"
    proc = run_script("bench_decode.py", "--preset", "small", "--configs", "DSV4_GRAPH=0",
                      "--concurrency", "2", "--contexts", "32", "--new-tokens", "3",
                      "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["errors"] == [] and record["model"]["weights"] == "native"
    native, bf16 = record["weight_reads"]
    assert set(native) == set(bf16) == WEIGHT_READ_KEYS
    assert (native["weights"], bf16["weights"]) == ("native", "bf16")
    assert native["concurrency"] == 2 and native["context_len"] == 32
    assert abs(native["bytes_read"] / native["native_active_bytes"] - 1) <= 0.15, native
    assert native["read_vs_native_active"] == round(
        native["bytes_read"] / native["native_active_bytes"], 4)
    assert bf16["bytes_read"] > 1.2 * native["bytes_read"], (bf16, native)
    assert native["kv_read_bytes"] > 0 and native["kv_written_bytes"] > 0
    if not torch.cuda.is_available():
        assert native["floor_ms"] is None                # no peak bandwidth on a CPU
        assert native["itl_vs_floor"] is None
        assert "no GPU here: no step time to set against the floor" in proc.stdout
    assert "weights native: one decode step (batch 2, context 32) reads " in proc.stdout


# ---- summary, plots, sweep ------------------------------------------------------------------


def fabricated_results(tmp_path: Path) -> Path:
    env = {"gpu_name": "AMD Instinct MI300X", "gpu_arch": "gfx942", "hip": "6.2",
           "torch": "2.13.0+rocm6.2", "platform": {"fp8_dialect": "fnuz"},
           "flags": {"DSV4_GRAPH": {"value": "1", "source": "default"}},
           "rocm_smi_productname": "Card series: AMD Instinct MI300X"}
    swa = {"quick": False, "launch_counter": "device_kernels", "graph_backend": "cuda", "results": [
        {"model": "flash", "n_layers": 43, "batch": 8, "mode": "eager", "method": m,
         "us_per_step_p50": us} for m, us in (("per_layer", 344.0), ("start_layer", 9.0),
                                              ("identity_cache", 10.0))],
        "derived": [{"model": "flash", "n_layers": 43, "batch": 8, "mode": "eager",
                     "translate_us_per_layer": 8.0, "launches_saved_per_step": 84,
                     "fused_marginal_us_per_layer": 0.25}]}
    decode = {"quick": False, "model": {"preset": "flash", "n_layers": 4, "n_layers_full": 43,
                                        "note": "flash shapes cut to 4/43 layers"},
              "env": env, "notes": [], "errors": [
                  {"config": "DSV4_KERNEL_BACKEND=hip", "concurrency": None,
                   "context_len": None, "error": "worker exited with 1: no hipcc"}],
              "results": [{"config": "default", "concurrency": 8, "context_len": 1024,
                           "itl_ms_p50": 10.0, "itl_ms_p90": 12.0,
                           "decode_tokens_per_s": 800.0, "itl_p50_vs_default": 1.0,
                           "swa_translations_per_step": None, "graph_used": True}]}
    d = tmp_path / "20260601T000000Z"
    d.mkdir()
    for name, rec in (("env", env), ("bench_swa_translation", swa), ("bench_decode", decode)):
        (d / f"{name}.json").write_text(json.dumps(rec))
    return d


def test_summary_places_numbers_beside_the_anchors(tmp_path):
    out = summarize_results.main([str(fabricated_results(tmp_path))])
    text = out.read_text()
    assert out.name == "summary.md"
    assert "AMD Instinct MI300X" in text and "gfx942" in text
    assert "Missing results: bench_set_kv" in text
    assert "8 us/layer" in text and "pull/26931" in text
    assert "| flash | 43 | 8 | eager | 344 | 9 | 10 | 8 | 1 | 84 | 0.25 |" in text
    assert "| default | 8 | 1024 | 10 | 12 | 800 | 1 | - | True |" in text
    assert "| 106 | 2256 |" in text                      # MI355X per-token latency anchor
    assert "flash x10.8 layers (extrapolated)" in text  # 10 ms * 43/4
    assert "| 108 |" in text
    assert "No H200 per-token latency" in text
    assert "worker exited with 1: no hipcc" in text


def test_summary_of_an_empty_directory_lists_what_is_missing(tmp_path):
    text = summarize_results.summarize(tmp_path)
    assert ("Missing results: bench_swa_translation, bench_set_kv, bench_decode" in text)
    assert "No environment record found" in text


def test_plots_are_skipped_with_a_message_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    assert plot_results.plot_all(fabricated_results(tmp_path)) == []
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_plots_are_written_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    written = plot_results.plot_all(fabricated_results(tmp_path))
    assert sorted(p.name for p in written) == [
        "bench_decode_itl.png", "bench_decode_tokens_per_s.png", "swa_translation.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_sweep_script_parses_and_its_dry_run_runs_nothing(tmp_path):
    sweep = SCRIPTS / "mi300_sweep.sh"
    assert subprocess.run(["bash", "-n", str(sweep)]).returncode == 0
    out_root = tmp_path / "results"
    proc = subprocess.run(["bash", str(sweep), "--dry-run", "--quick", "--out-root",
                           str(out_root)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for script in ("bench_common.py", "bench_swa_translation.py --quick",
                   "bench_decode.py --quick", "bench_long_context.py --quick",
                   "plot_results.py", "summarize_results.py"):
        assert f"scripts/{script}" in proc.stdout, script
    assert not out_root.exists()
    bad = subprocess.run(["bash", str(sweep), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option" in bad.stderr


def test_sglang_plugin_quick_compares_stock_and_plugin(tmp_path):
    """Both paths in one process; on a CPU SGLang's stock kernel cannot run and says why."""
    from sglang_host import stub_path_env

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (see README)")
    out = tmp_path / "sglang_plugin.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_sglang_plugin.py"), "--quick", "--no-progress",
         "--models", "flash", "--batches", "2", "--warmup", "1", "--reps", "2", "--out",
         str(out)], capture_output=True, text=True, timeout=300, env=stub_path_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    check_record(record, "bench_sglang_plugin")
    assert record["plugin"].startswith("sglang 0.5.23: would replace")
    rows = {(r["mode"], r["path"]): r for r in record["results"]}
    assert set(rows) == {(m, p) for m in ("eager", "graph") for p in ("sglang_stock",
                                                                        "dsv4_plugin")}
    for mode in ("eager", "graph"):
        ours = rows[(mode, "dsv4_plugin")]
        assert ours["n_layers"] == 43 and ours["launches_per_step"] > 0
        assert ours["us_per_step_p50"] > 0
        if not torch.cuda.is_available():
            assert "only the ROCm K launch ropes q" in rows[(mode, "sglang_stock")]["unavailable"]
    assert rows[("graph", "dsv4_plugin")]["host_syncs_per_step"] == 0


def test_bench_decode_prints_its_figures():
    import bench_decode

    rows = [{"config": "DSV4_GRAPH=0+DSV4_NUMERICS=fp32", "concurrency": 4, "context_len": 32,
             "itl_ms_p50": 12.345, "decode_tokens_per_s": 258.04, "graph_used": False,
             "forward_ops_per_layer": 35.25, "layer_ops_max": 38},
            {"config": "default", "concurrency": 4, "context_len": 32, "itl_ms_p50": 2.0,
             "decode_tokens_per_s": 2000.0, "graph_used": True, "layer_ops_max": None}]
    errors = [{"config": "default", "concurrency": 1, "context_len": 32, "error": "boom"}]
    header, line, graph, error = bench_decode.summary_lines(rows, errors)
    assert header.split() == ["config", "batch", "context", "ITL", "p50", "ms", "decode",
                              "tok/s", "graph", "ops/layer", "(max", "layer)"]
    assert line.split() == ["DSV4_GRAPH=0+DSV4_NUMERICS=fp32", "4", "32", "12.35", "258.0", "no",
                            "35.2", "(38)"]
    assert graph.split()[-2:] == ["yes", "-"]
    assert error == "error: default, concurrency 1, context 32: boom"


def test_progress_bars_only_on_a_terminal(monkeypatch):
    import io

    monkeypatch.setattr(sys, "stderr", io.StringIO())       # a pipe or a log file
    with bc.progress(3, "x") as bar:
        bar.update()
    assert sys.stderr.getvalue() == ""
    assert bc.progress(3, "x", disable=True).disable
