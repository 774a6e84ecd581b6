"""scripts/bench_long_context.py: its --quick run writes the documented JSON (fields and counts,
never times), its markdown table and plot, and its bad options end with the option's name."""

import importlib.util
import json

import pytest
import torch

from bench_runner import check_record, run_script

import bench_common as bc  # noqa: E402  (scripts/ is on the path through bench_runner)
import bench_long_context as blc  # noqa: E402
import decode_launches  # noqa: E402
import plot_results  # noqa: E402

ROW_KEYS = {"prompt_len", "new_tokens", "prefill_chunk", "prefill_steps", "prefill_ms",
            "prefill_ms_per_token", "prefill_tokens_per_s", "ttft_ms", "decode_steps",
            "decode_ms_p50", "decode_ms_p90", "decode_ms_max", "decode_step_ms", "graph_used",
            "kv_pool_bytes", "rss_before_bytes", "peak_rss_bytes", "device_before_bytes",
            "peak_device_bytes", "kv_read_bytes", "kv_written_bytes", "floor_bytes", "floor_ms",
            "decode_vs_floor", "worker_s"}


@pytest.mark.slow
def test_quick_run_writes_one_point_per_prompt_length(tmp_path):
    from dsv4.config import ModelConfig

    out, png = tmp_path / "bench_long_context.json", tmp_path / "figure.png"
    proc = run_script("bench_long_context.py", "--quick", "--no-progress", "--out", str(out),
                      "--markdown", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (2 points, 0 errors)" in proc.stdout
    record = json.loads(out.read_text())
    check_record(record, "bench_long_context")
    assert record["machine"] == bc.machine_name()
    assert record["errors"] == []
    assert record["model"]["preset"] == "tiny" and record["model"]["weights"] == "bf16"
    rows = record["results"]
    assert [r["prompt_len"] for r in rows] == [128, 256]
    config, gpu = ModelConfig.preset("tiny"), torch.cuda.is_available()
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["new_tokens"] == 3 and r["decode_steps"] == 2 and not r["graph_used"]
        # one request shorter than the chunk: one extend step
        assert r["prefill_steps"] == 1 and r["prefill_chunk"] >= r["prompt_len"]
        assert 0 < r["decode_ms_p50"] <= r["decode_ms_p90"] <= r["decode_ms_max"]
        assert len(r["decode_step_ms"]) == 2 and max(r["decode_step_ms"]) == r["decode_ms_max"]
        assert r["prefill_tokens_per_s"] > 0 and r["ttft_ms"] > 0
        assert 0 < r["rss_before_bytes"] <= r["peak_rss_bytes"]
        assert (r["peak_device_bytes"] is None) is (not gpu)
        kv = decode_launches.kv_bytes(config, 1, r["prompt_len"] + 1)
        assert (r["kv_read_bytes"], r["kv_written_bytes"]) == (kv["kv_read_bytes"],
                                                               kv["kv_written_bytes"])
        assert r["floor_bytes"] == (record["weight_bytes_per_step"] + kv["kv_read_bytes"]
                                    + kv["kv_written_bytes"])
        if record["hbm_bytes_per_s"] is None:
            assert r["floor_ms"] is None and r["decode_vs_floor"] is None
    assert rows[1]["kv_read_bytes"] > rows[0]["kv_read_bytes"]   # more compressed rows
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| prompt tokens |"))
    assert lines[header + 1].startswith("|---|")
    assert [line.split(" | ")[0] for line in lines[header + 2:header + 4]] == ["| 128", "| 256"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 1000
        assert [p.name for p in plot_results.plot_all(tmp_path)] == ["long_context.png"]


def test_table_shows_the_gpu_columns_only_when_measured():
    row = {"prompt_len": 16384, "prefill_chunk": 8192, "prefill_ms": 123456.0,
           "prefill_ms_per_token": 7.5352, "prefill_tokens_per_s": 132.71,
           "decode_ms_p50": 20.04, "peak_rss_bytes": 2 ** 30, "peak_device_bytes": None,
           "floor_bytes": 3_700_000, "floor_ms": None, "decode_vs_floor": None}
    header, rule, line = blc.table([row], markdown=True)
    assert header == ("| prompt tokens | chunk | prefill s | prefill ms/token | prefill "
                      "tokens/s | decode step p50 ms | peak RSS GiB | floor MB |")
    assert rule == "|---|---|---|---|---|---|---|---|"
    assert line == "| 16,384 | 8,192 | 123.5 | 7.54 | 132.7 | 20.0 | 1.00 | 3.70 |"
    gpu = {**row, "peak_device_bytes": 3 * 2 ** 29, "floor_ms": 0.0008, "decode_vs_floor": 2.5}
    header, line = blc.table([gpu], markdown=False)
    assert header.endswith("peak RSS GiB  peak device GiB  floor MB  floor ms  p50 / floor")
    assert line.split()[-5:] == ["1.00", "1.50", "3.70", "0.001", "2.5"]


def test_a_point_past_its_time_limit_is_an_error_not_a_row():
    row = blc.run_worker({"prompt_len": 64}, timeout=0.01)
    assert row == {"prompt_len": 64, "error": "ran past --point-timeout 0.01 s"}


@pytest.mark.parametrize("args, message", [
    (["--prefill-chunk", "-1"], "--prefill-chunk must be >= 0"),
    (["--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 2"),
    (["--prompt-lens", "0,128"], "--prompt-lens must be >= 1"),
    (["--hbm-bandwidth", "0"], "--hbm-bandwidth must be > 0 TB/s"),
])
def test_bad_options_exit_2_naming_the_option(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        blc.parse_args(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
