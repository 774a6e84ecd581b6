"""What `python -m dsv4 generate` reports, from known inputs, in-process: the report's text
(counts, checkpoint, passes, why a run is eager), the numbers `build_report` derives from the
engine's counters, and `--estimate-only --json` against its text lines."""

import json

import pytest


def report(n_tokens: list[int], passes: int = 1, prefix_cache: bool = False) -> dict:
    tokens = [[7] * n for n in n_tokens]
    one = {"prefix_hit_rate": 0.0, "prefix_hit_tokens": 0, "prompt_tokens": 3,
           "prefill_ms": 1.0, "tokens": tokens}
    return {"tokens": tokens, "errors": [None] * len(tokens), "graph": False,
            "graph_backend": None, "device": "cpu", "ttft_ms": 1.0, "decode_steps": 0,
            "tokens_per_s": 1.0, "swa_translations_per_step": None,
            "swa_cache_hits_per_step": None, "retractions": 0, "prefix_cache": prefix_cache,
            "weights": "native", "weights_reason": "default: the published FP8/FP4 formats",
            "prefill_chunk": 256, "prefill_chunk_source": "auto",
            "pool_usage": {"full_tokens_peak": 1, "full_tokens": 2, "swa_tokens_peak": 1,
                           "swa_tokens": 2, "peak_fraction": 0.5},
            "passes": [{"pass": i, **one} for i in range(passes)]}


def test_report_counts_say_one_prompt_and_one_token(capsys):
    from dsv4.cli_generate import print_report

    print_report(report([1]), 1, None)
    assert "generated 1 token for 1 prompt on cpu; graphs: no (eager)" in capsys.readouterr().out
    print_report(report([2, 1]), 2, None)
    assert "generated 3 tokens for 2 prompts on cpu" in capsys.readouterr().out


def test_report_names_the_checkpoint_without_a_tokenizer(capsys):
    from dsv4.cli_generate import print_report

    print_report(report([1]), 1, None, model_path="/ckpt")
    out = capsys.readouterr().out
    assert "(no tokenizer: /ckpt has no tokenizer.json; token ids only)" in out
    assert "preset" not in out
    print_report(report([1]), 1, None)
    assert "the built-in presets have none" in capsys.readouterr().out


@pytest.mark.parametrize("passes, prefix_cache, lines", [(1, False, 0), (1, True, 1),
                                                         (2, False, 2)])
def test_pass_lines_only_where_they_add_something(capsys, passes, prefix_cache, lines):
    from dsv4.cli_generate import print_report

    print_report(report([1], passes, prefix_cache), 1, None)
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if line.startswith("pass ")]) == lines


@pytest.mark.parametrize("source, said", [("auto", "sized from the device memory"),
                                          ("--prefill-chunk", "--prefill-chunk"),
                                          ("DSV4_PREFILL_CHUNK", "DSV4_PREFILL_CHUNK")])
def test_the_prefill_line_gives_the_chunk_and_what_chose_it(capsys, source, said):
    from dsv4.cli_generate import print_report

    print_report({**report([1]), "prefill_chunk_source": source}, 1, None)
    assert (f"prefill: time to first token 1.0 ms; chunks of at most 256 tokens ({said})"
            in capsys.readouterr().out.splitlines())


def test_an_eager_run_says_why_it_is_eager(capsys):
    from dsv4.cli_generate import print_report

    print_report({**report([1]), "eager_reason": "tensor parallel on a CPU runs eagerly"}, 1, None)
    assert ("graphs: no (eager: tensor parallel on a CPU runs eagerly)"
            in capsys.readouterr().out)


def test_the_reports_numbers_come_from_the_engines_counters():
    """Rates are tokens over seconds, latencies the steps' percentiles in ms, 3 decimals kept."""
    from dsv4.cli_generate import build_report
    from dsv4.engine import EngineStats

    stats = EngineStats(decode_step_s=[0.012, 0.010, 0.0305], decode_tokens=7,
                        first_token_s=0.0123456, graph_steps=1, eager_swa_translations=3,
                        eager_swa_hits=1, retractions=2, peak_full_tokens=30, peak_swa_tokens=9)
    r = build_report(stats, "cpu", "emu", (70, 16), 0.3, [[1, 2, 3], [4]], [None, "retracted"])
    assert r == {
        "device": "cpu", "tokens": [[1, 2, 3], [4]], "errors": [None, "retracted"],
        "graph": True, "graph_backend": "emu", "ttft_ms": 12.346, "decode_steps": 3,
        "decode_tokens_per_s": 133.333, "step_latency_ms_p50": 12.0,
        "step_latency_ms_p90": 30.5, "tokens_per_s": 13.333,
        "swa_translations_per_step": 1.5, "swa_cache_hits_per_step": 0.5,
        "pool_usage": {"full_tokens_peak": 30, "full_tokens": 70, "swa_tokens_peak": 9,
                       "swa_tokens": 16, "peak_fraction": 0.4286},
        "retractions": 2}


def test_estimate_only_json_line_matches_the_printed_estimate(capsys, flag_env):
    """`--estimate-only --json`: the two lines of text, then one JSON object with the same
    numbers in bytes (the weights and the KV cache of one rank, their total with the prefill,
    the device's bytes and whether it fits)."""
    from dsv4.cli import main

    flag_env()
    for args, fits in ((["--preset", "pro", "--tp", "8", "--device-memory", "192"], True),
                       (["--preset", "tiny", "--device-memory", "0.001"], False)):
        assert main(["generate", "--estimate-only", "--json", *args]) == 0
        text, line = capsys.readouterr().out.strip().rsplit("\n", 1)
        r = json.loads(line)
        assert set(r) == {"tp", "weights", "weight_bytes_per_rank", "kv_bytes",
                          "total_bytes_per_rank", "device_bytes", "fits", "prefill_chunk"}
        assert r["tp"] == (8 if "--tp" in args else 1) and r["fits"] is fits
        assert r["device_bytes"] == int(float(args[-1]) * 2 ** 30)
        assert r["total_bytes_per_rank"] >= r["weight_bytes_per_rank"] + r["kv_bytes"]
        total, weights, kv, device = (r[k] / 2 ** 30 for k in (
            "total_bytes_per_rank", "weight_bytes_per_rank", "kv_bytes", "device_bytes"))
        assert text.splitlines() == [
            f"memory per rank (--tp {r['tp']}, {r['weights']} weights): {total:.1f} GiB "
            f"({weights:.1f} GiB of weights, {kv:.2f} GiB of KV cache, "
            f"{total - weights - kv:.2f} GiB for the prefill step)",
            f"fits a {float(args[-1]):g} GiB device ({device:.1f} GiB): {'yes' if fits else 'no'}",
            f"prefill chunk: {r['prefill_chunk']} tokens (sized from the device memory)"]
