"""`python -m dsv4 generate`: the tokens it prints, the prefill/decode report, prompts,
sampling, a checkpoint with a tokenizer, one-line errors with exit status 2 found before the model
is built, and the report's wording, run in this process through dsv4.cli.main; the README's main
command and --debug's traceback in a subprocess, as a user starts them."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4 import ModelConfig, save_random_checkpoint

KEYS = {"tokens", "ttft_ms", "decode_tokens_per_s", "tokens_per_s", "step_latency_ms_p50",
        "step_latency_ms_p90", "swa_translations_per_step", "graph", "pool_usage", "weights",
        "weights_reason", "prefill_chunk"}


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env.update(extra)
    return env


def cli(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "dsv4", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or clean_env())


def finish(proc, rc=0):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == rc, err[-3000:]
    return out, err


@pytest.fixture
def generate(capsys, flag_env):
    """`python -m dsv4 generate --json`, a short run of the tiny preset (the fastest), in this
    process with no DSV4_* flag set; ARGS come last and may name another preset. Returns the
    printed lines before the JSON, the JSON report and stderr."""
    from dsv4.cli import main

    def run(*args):
        flag_env()
        rc = main(["generate", "--json", "--preset", "tiny", "--batch", "3", "--prompt-len",
                   "16", "--max-new-tokens", "5", *args])
        out, err = capsys.readouterr()
        assert rc == 0, err
        lines = out.strip().splitlines()
        return lines[:-1], json.loads(lines[-1]), err

    return run


def printed_tokens(text):
    """{request: ids} from the 'request i: n tokens: ...' lines."""
    out = {}
    for line in text:
        if line.startswith("request "):
            head, ids = line.split(" tokens: ")
            out[int(head.split()[1].rstrip(":"))] = [int(t) for t in ids.split()]
    return out


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_generate_reports_prefill_decode_and_pool_usage(generate, graph):
    text, r, err = generate("--graph" if graph else "--no-graph")
    assert KEYS <= set(r)
    assert r["graph"] is graph and r["decode_steps"] == 4
    assert 0 < r["step_latency_ms_p50"] <= r["step_latency_ms_p90"]
    assert r["ttft_ms"] > 0 and r["decode_tokens_per_s"] > 0 and r["tokens_per_s"] > 0
    if graph:  # the gather runs inside the replayed graph, unseen by the pool's counters
        assert r["swa_translations_per_step"] is None
        assert any("n/a (graph replay" in line for line in text)
    else:      # one gather per step, in the attention metadata, shared by every layer
        assert r["swa_translations_per_step"] == 1.0
        assert r["swa_cache_hits_per_step"] == 0.0
    assert 0 < r["pool_usage"]["full_tokens_peak"] <= r["pool_usage"]["full_tokens"]
    assert any(line.startswith("prefill: time to first token") for line in text)
    assert any(line.startswith("decode: ") and "tokens/s" in line for line in text)
    assert printed_tokens(text) == dict(enumerate(r["tokens"]))
    assert err == ""  # not a terminal: no progress bar
    assert r["weights"] == "bf16" and "dim=64" in r["weights_reason"]  # tiny: too narrow
    assert f"weights: bf16 ({r['weights_reason']})" in text


def test_readme_main_command_prints_the_engines_tokens():
    """The README's main command (defaults: small preset in the published formats, seed 0, 4
    random prompts of 32 ids, 16 new tokens, graphs) prints the tokens the engine generates for
    the same inputs (the engine here runs eagerly: graphs and eager give the same bits, and
    the capture would double the test's time)."""
    from dsv4 import DeepseekV4Model, init_random_weights
    from dsv4.engine import Engine

    out, _ = finish(cli("generate"))
    assert "weights: native (default: the published FP8/FP4 formats)" in out
    got = printed_tokens(out.splitlines())
    model = init_random_weights(DeepseekV4Model(ModelConfig.preset("small"), max_seq_len=48,
                                                weights="native"), seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, model.config.vocab_size, (4, 32), generator=g).tolist()
    engine = Engine(model, max_batch=4, max_context_len=48,
                    eos_token_id=model.config.eos_token_id, graph=False)
    want = engine.generate(prompts, 16).tokens
    assert got == dict(enumerate(want))
    assert all(1 <= len(t) <= 16 for t in want)


def test_one_new_token_has_no_decode_step(generate):
    text, r, _ = generate("--max-new-tokens", "1", "--no-graph")
    assert r["decode_steps"] == 0 and r["decode_tokens_per_s"] is None
    assert [len(t) for t in r["tokens"]] == [1, 1, 1]
    assert "decode: no decode step (every request ended at its first token)" in text


def test_prompts_and_sampling(generate, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5,6,7\n\n8, 9\n")
    sampled = ("--batch", "2", "--ignore-eos", "--temperature", "1.5", "--top-k", "50",
               "--top-p", "0.9", "--seed", "3")
    runs = {
        "ids": ("--prompt-ids", "3,4,5,6", "--ignore-eos", "--no-graph"),
        "file": ("--prompt-file", str(prompts), "--no-graph"),
        "greedy": ("--batch", "2", "--ignore-eos", "--no-graph"),
        "sampled": (*sampled, "--no-graph"),
        "again": (*sampled, "--no-graph"),
    }
    reports = {k: generate(*args)[1] for k, args in runs.items()}
    r = {k: report["tokens"] for k, report in reports.items()}
    assert len(r["ids"]) == 1 and len(r["ids"][0]) == 5
    assert reports["ids"]["passes"][0]["prompt_tokens"] == 4
    assert len(r["file"]) == 2 and reports["file"]["passes"][0]["prompt_tokens"] == 5
    assert r["sampled"] == r["again"]          # a seed gives the same tokens
    assert r["sampled"] != r["greedy"]


def test_checkpoint_with_a_tokenizer_prints_text(generate, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_random_checkpoint(ModelConfig.preset("tiny"), tmp_path, seed=1, shards=1)
    vocab = {f"w{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    text, r, _ = generate("--model-path", str(tmp_path), "--prompt", "w7 w8 w9", "--no-graph",
                          "--ignore-eos")
    assert len(r["tokens"]) == 1 and len(r["tokens"][0]) == 5
    assert f"  text: {tok.decode(r['tokens'][0])!r}" in text


ERRORS = {  # arguments (and environment) -> the one line expected on stderr
    "batch 0": (["--batch", "0"], {}, "error: --batch must be >= 1, got 0"),
    "bad flag value": ([], {"DSV4_GRAPH": "maybe"},
                       "error: DSV4_GRAPH='maybe': expected one of 0/1/true/false/on/off"),
    "unknown preset": (["--preset", "huge"], {},
                       "error: unknown preset 'huge'; choose one of ['flash', 'pro', 'small', "
                       "'tiny']"),
    "missing checkpoint": (["--model-path", "/nonexistent"], {},
                           "error: --model-path /nonexistent: no config.json there"),
    "text without tokenizer": (["--prompt", "hello"], {}, "error: --prompt is text and needs a "
                               "tokenizer"),
    "bad ids": (["--prompt-ids", "1,x"], {}, "error: --prompt-ids must be comma-separated"),
    "too large": (["--preset", "flash"], {}, "error: this run needs about 148."),
    "too large in bf16": (["--preset", "flash", "--weights", "bf16"], {},
                          "error: this run needs about 531."),
    "too narrow for native": (["--preset", "tiny", "--weights", "native"], {},
                              "error: --weights native: the FP8/FP4 linears need input dims that "
                              "are multiples of 128; this config has dim=64, q_lora_rank=32, "
                              "o_groups*o_lora_rank=64, moe_inter_dim=32; use --weights bf16"),
    "prefill chunk too large for the device": (["--prompt-len", "100000", "--prefill-chunk",
                                                "100000", "--device-memory", "4"], {},
                                               "error: this run needs about "),
    "prefill chunk 0": (["--prefill-chunk", "0"], {},
                        "error: --prefill-chunk must be a whole number of tokens >= 1 or auto, "
                        "got '0'"),
    "negative prefill chunk flag": ([], {"DSV4_PREFILL_CHUNK": "-1"},
                                    "error: prefill_chunk=-1: expected an int >= 1, or 0"),
    "bad sampling": (["--top-p", "0"], {}, "error: top_p must be in (0, 1], got 0.0"),
}


def run_main(capsys, *args):
    """`python -m dsv4 generate ARGS` in this process: (exit status, stdout, stderr lines)."""
    from dsv4.cli import main

    rc = main(["generate", "--quiet", *args])
    out, err = capsys.readouterr()
    return rc, out, [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def nothing_built(monkeypatch):
    """A user error must be found before the model is built (no weights, no pool allocated)."""
    from dsv4 import cli_generate

    def refuse(*args):
        raise AssertionError("the model was built before the error was found")

    monkeypatch.setattr(cli_generate, "_model", refuse)


def test_user_errors_end_in_one_line_and_status_2(tmp_path, capsys, flag_env, nothing_built):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    no_model_keys = tmp_path / "foo"
    no_model_keys.mkdir()
    (no_model_keys / "config.json").write_text('{"foo": 1}')
    long_ckpt = tmp_path / "ckpt"
    long_ckpt.mkdir()
    (long_ckpt / "config.json").write_text(json.dumps(ModelConfig.preset("tiny").to_dict()))
    cases = dict(ERRORS)
    cases["corrupt config"] = (["--model-path", str(corrupt)], {},
                               f"error: {corrupt}/config.json: not valid JSON (Expecting property")
    cases["config without model keys"] = (
        ["--model-path", str(no_model_keys)], {},
        f"error: {no_model_keys}/config.json: no DeepSeek-V4 model key in it (expected keys such "
        "as dim or hidden_size, n_layers or num_hidden_layers")
    cases["prompt longer than the context"] = (
        ["--model-path", str(long_ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "5000"], {},
        "error: a prompt of 3 tokens plus --max-new-tokens 5000 needs 5003 positions; this "
        "model covers 4096")
    flags_used = {flag for _, env, _ in cases.values() for flag in env}
    for name, (args, env, expected) in cases.items():
        flag_env(**{**dict.fromkeys(flags_used), **env})    # None: unset
        rc, _, err = run_main(capsys, *args)
        assert rc == 2 and len(err) == 1 and err[0].startswith(expected), (name, err)


def test_a_truncated_shard_is_one_line(tmp_path, capsys, flag_env):
    truncated = tmp_path / "truncated"
    save_random_checkpoint(ModelConfig.preset("tiny"), truncated, shards=1)
    shard = next(truncated.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100_000])
    rc, _, err = run_main(capsys, "--model-path", str(truncated))
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"error: {shard}: not a readable safetensors file")


def test_unknown_config_keys_are_one_warning_line(tmp_path, capsys, flag_env, nothing_built,
                                                  monkeypatch):
    """Read before the estimate and again by the loader, the config warns once, on stderr; a
    tensor-parallel rank other than 0 prints only the error."""
    d = {**ModelConfig.preset("tiny").to_dict(), "foo": 1, "bar": 2}
    (tmp_path / "config.json").write_text(json.dumps(d))
    rc, _, err = run_main(capsys, "--model-path", str(tmp_path), "--prompt-ids", "1,2,3",
                          "--max-new-tokens", "5000")
    assert rc == 2
    assert err[0] == f"warning: {tmp_path}/config.json: ignoring unknown config keys: bar, foo"
    assert len(err) == 2 and err[1].startswith("error: a prompt of 3 tokens")
    monkeypatch.setenv("RANK", "1")     # another torchrun rank: the error alone
    rc, _, err = run_main(capsys, "--model-path", str(tmp_path), "--prompt-ids", "1,2,3",
                          "--max-new-tokens", "5000")
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: a prompt of 3 tokens")


def test_a_checkpoints_default_weights_follow_what_it_stores(tmp_path):
    """As load_model chooses: native for quantized tensors (where the dims allow), else bf16."""
    from dsv4.cli_generate import weight_format

    small = ModelConfig.preset("small")
    plain = save_random_checkpoint(small, tmp_path / "plain", quantize=False, shards=1)
    quantized = save_random_checkpoint(small, tmp_path / "quantized", shards=1)

    def args(path, weights=None):
        return argparse.Namespace(model_path=str(path), weights=weights)

    assert weight_format(args(plain), small) == (
        "bf16", "default for a checkpoint of unquantized weights")
    assert weight_format(args(quantized), small)[0] == "native"
    assert weight_format(args(plain, "native"), small) == ("native", "--weights native")


@pytest.mark.parametrize("asked, built", [([], "native"), (["--weights", "bf16"], "bf16")])
def test_the_model_generate_builds_holds_the_format_the_report_names(
        monkeypatch, capsys, flag_env, asked, built):
    import dsv4
    from dsv4.cli import main

    class Built(Exception):
        pass

    def record(config, **kwargs):
        raise Built(kwargs["weights"])

    flag_env()
    monkeypatch.setattr(dsv4, "DeepseekV4Model", record)
    with pytest.raises(Built) as model:
        main(["generate", "--quiet", "--preset", "small", "--batch", "1", "--prompt-len", "2",
              "--max-new-tokens", "2", *asked])
    assert str(model.value) == built


def test_the_prefill_is_part_of_the_memory_estimate():
    from dsv4.memory_estimate import estimate, prefill_bytes

    tiny = ModelConfig.preset("tiny")
    big = estimate(tiny, 4, 100_016, prefill_tokens=4096)   # one chunk of 4096 tokens
    assert big.prefill_bytes == prefill_bytes(tiny, 4096, 100_016, batch=4) > 0
    assert big.total_bytes == big.weight_bytes + big.kv_bytes + big.prefill_bytes
    assert "GiB for the prefill step" in big.describe()
    assert estimate(tiny, 4, 48).prefill_bytes == 0   # no prefill tokens given: no prefill


def test_every_generate_option_says_its_default():
    from dsv4.cli import build_parser

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    for action in generate._actions:   # `is`: a default of 0 (--top-k, --seed) == False
        if action.option_strings and not any(action.default is none
                                             for none in (None, False, argparse.SUPPRESS)):
            assert action.help and "default" in action.help, action.option_strings
    assert "(default 16)" in generate.format_help()


def test_every_option_of_every_command_is_explained_in_its_help():
    from dsv4.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0]
    assert set(commands.choices) == {"env", "generate"}
    top = parser.format_help()
    for choice in commands._choices_actions:   # each command's line in `python -m dsv4 --help`
        assert choice.help and choice.dest in top, choice.dest
    for name, sub in commands.choices.items():
        text = sub.format_help()
        for action in sub._actions:
            for option in action.option_strings:
                assert action.help and option in text, (name, option)


def test_debug_shows_the_traceback():
    _, err = finish(cli("generate", "--batch", "0", "--debug"), rc=1)
    assert "Traceback" in err and "UsageError: --batch must be >= 1, got 0" in err


def test_the_seed_picks_the_sampled_tokens(generate, tmp_path):
    """A checkpoint's weights and given prompt ids do not depend on --seed: only the sampling
    does, so one seed repeats its tokens and another seed draws others."""
    save_random_checkpoint(ModelConfig.preset("tiny"), tmp_path, seed=1, shards=1)

    def tokens(seed):
        return generate("--model-path", str(tmp_path), "--prompt-ids", "5,6,7", "--ignore-eos",
                        "--no-graph", "--temperature", "1.5", "--seed", seed)[1]["tokens"]

    first = tokens("3")
    assert tokens("3") == first
    assert tokens("4") != first


def test_prompt_file_errors_name_the_file_and_the_line(tmp_path, capsys, flag_env,
                                                       nothing_built):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5,6,7\nhello there\n")
    rc, _, err = run_main(capsys, "--prompt-file", str(prompts))
    assert rc == 2 and err == [f"error: {prompts} line 2 is text and needs a tokenizer: give "
                               "--model-path DIR with a tokenizer.json (the built-in presets "
                               "have none), or token ids"]
    prompts.write_text("5,6,7\n\n  \nhello there\n")       # blank lines count as lines
    rc, _, err = run_main(capsys, "--prompt-file", str(prompts))
    assert rc == 2 and err[0].startswith(f"error: {prompts} line 4 is text")
    missing = tmp_path / "absent.txt"
    rc, _, err = run_main(capsys, "--prompt-file", str(missing))
    assert rc == 2 and err == [f"error: --prompt-file {missing}: no such file"]


def test_a_second_pass_reuses_the_cached_prefix(generate):
    """--prefix-cache --repeat 2: the first pass finds nothing, the second reuses the whole
    256-token page of each prompt (not the partial last page) and generates the same tokens."""
    _, r, _ = generate("--prefix-cache", "--repeat", "2", "--batch", "2", "--prompt-len", "257",
                       "--max-new-tokens", "2", "--no-graph")
    first, second = r["passes"]
    assert r["prefix_cache"] is True
    assert (first["prefix_hit_tokens"], first["prompt_tokens"]) == (0, 514)
    assert (second["prefix_hit_tokens"], second["prompt_tokens"]) == (512, 514)
    assert second["prefix_hit_rate"] == round(512 / 514, 4)
    assert first["tokens"] == second["tokens"] == r["tokens"]
    assert first["prefill_ms"] > 0 and second["prefill_ms"] > 0


GLOO_CLOSED = "[gloo] Connection closed by peer [10.0.0.2]:29500 "


@pytest.mark.parametrize("raised, shown", [
    (RuntimeError(GLOO_CLOSED + "x" * 200 + "\nException raised from recvBytes"),
     GLOO_CLOSED + "x" * (160 - len(GLOO_CLOSED))),                 # the first line's first 160
    (torch.distributed.DistBackendError(), "DistBackendError"),     # no message: its type
], ids=["long first line", "no message"])
def test_a_stopped_peer_ends_a_rank_in_one_line_and_status_3(capsys, monkeypatch, flag_env,
                                                              raised, shown):
    """Under --tp, a collective failing because another rank stopped ends this rank with one
    line naming its rank and the first line of the error, cut at 160 characters."""
    from dsv4 import cli_generate

    def peer_stops(args):
        raise raised

    flag_env()
    monkeypatch.setattr(cli_generate, "run", peer_stops)
    monkeypatch.setenv("RANK", "1")
    rc, out, err = run_main(capsys)
    assert rc == 3 and out == "" and len(err) == 1, err
    assert err[0].startswith("error: rank 1: another tensor-parallel rank stopped"), err
    assert err[0].endswith(f"({shown})"), err


def test_an_error_that_is_not_a_stopped_peer_keeps_its_traceback(monkeypatch, flag_env):
    from dsv4 import cli_generate
    from dsv4.cli import main

    def fails(args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    flag_env()
    monkeypatch.setattr(cli_generate, "run", fails)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        main(["generate", "--quiet"])
