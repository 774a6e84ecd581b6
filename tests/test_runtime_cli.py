"""`python -m dsv4 generate` in subprocesses: the tokens it prints, the prefill/decode report,
prompts, sampling, a checkpoint with a tokenizer, and one-line errors with exit status 2."""

import json
import os
import subprocess
import sys

import pytest
import torch

KEYS = {"tokens", "ttft_ms", "decode_tokens_per_s", "tokens_per_s", "step_latency_ms_p50",
        "step_latency_ms_p90", "swa_translations_per_step", "graph", "pool_usage"}


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


def generate(*args):
    out, err = finish(cli("generate", "--json", "--batch", "3", "--prompt-len", "16",
                          "--max-new-tokens", "5", *args))
    lines = out.strip().splitlines()
    return lines[:-1], json.loads(lines[-1]), err


def printed_tokens(text):
    """{request: ids} from the 'request i: n tokens: ...' lines."""
    out = {}
    for line in text:
        if line.startswith("request "):
            head, ids = line.split(" tokens: ")
            out[int(head.split()[1].rstrip(":"))] = [int(t) for t in ids.split()]
    return out


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_generate_reports_prefill_decode_and_pool_usage(graph):
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


def test_readme_main_command_prints_the_engines_tokens(one_thread):
    """The README's main command (defaults: tiny preset, seed 0, 4 random prompts of 32 ids,
    16 new tokens, graphs) prints the tokens the engine generates for the same inputs."""
    from dsv4.engine import Engine
    from tiny_model import tiny_model

    out, _ = finish(cli("generate"))
    got = printed_tokens(out.splitlines())
    model = tiny_model(max_seq_len=48, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, model.config.vocab_size, (4, 32), generator=g).tolist()
    engine = Engine(model, max_batch=4, max_context_len=48,
                    eos_token_id=model.config.eos_token_id, graph=True)
    want = engine.generate(prompts, 16).tokens
    assert got == dict(enumerate(want))
    assert all(1 <= len(t) <= 16 for t in want)


def test_one_new_token_has_no_decode_step():
    text, r, _ = generate("--max-new-tokens", "1", "--no-graph")
    assert r["decode_steps"] == 0 and r["decode_tokens_per_s"] is None
    assert [len(t) for t in r["tokens"]] == [1, 1, 1]
    assert "decode: no decode step (every request ended at its first token)" in text


def test_prompts_and_sampling(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5,6,7\n\n8, 9\n")
    runs = {
        "ids": cli("generate", "--json", "--no-graph", "--prompt-ids", "3,4,5,6", "--ignore-eos"),
        "file": cli("generate", "--json", "--no-graph", "--prompt-file", str(prompts)),
        "greedy": cli("generate", "--json", "--no-graph", "--batch", "2", "--ignore-eos"),
        "sampled": cli("generate", "--json", "--no-graph", "--batch", "2", "--ignore-eos",
                       "--temperature", "1.5", "--top-k", "50", "--top-p", "0.9", "--seed", "3"),
        "again": cli("generate", "--json", "--no-graph", "--batch", "2", "--ignore-eos",
                     "--temperature", "1.5", "--top-k", "50", "--top-p", "0.9", "--seed", "3"),
    }
    r = {k: json.loads(finish(p)[0].strip().splitlines()[-1])["tokens"] for k, p in runs.items()}
    assert len(r["ids"]) == 1 and len(r["ids"][0]) == 16
    assert len(r["file"]) == 2
    assert r["sampled"] == r["again"]          # a seed gives the same tokens
    assert r["sampled"] != r["greedy"]


def test_checkpoint_with_a_tokenizer_prints_text(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dsv4 import ModelConfig, save_random_checkpoint

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
                       "error: unknown preset 'huge'; choose one of ['flash', 'pro', 'tiny']"),
    "missing checkpoint": (["--model-path", "/nonexistent"], {},
                           "error: --model-path /nonexistent: no config.json there"),
    "text without tokenizer": (["--prompt", "hello"], {}, "error: --prompt is text and needs a "
                               "tokenizer"),
    "bad ids": (["--prompt-ids", "1,x"], {}, "error: --prompt-ids must be comma-separated"),
    "too large": (["--preset", "flash"], {}, "error: this run needs about 531."),
    "bad sampling": (["--top-p", "0"], {}, "error: top_p must be in (0, 1], got 0.0"),
}


def test_user_errors_end_in_one_line_and_status_2(tmp_path):
    from dsv4 import ModelConfig, save_random_checkpoint

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    long_ckpt = tmp_path / "ckpt"
    save_random_checkpoint(ModelConfig.preset("tiny"), long_ckpt, shards=1)
    cases = dict(ERRORS)
    cases["corrupt config"] = (["--model-path", str(corrupt)], {},
                               f"error: {corrupt}/config.json: not valid JSON (Expecting property")
    truncated = tmp_path / "truncated"
    save_random_checkpoint(ModelConfig.preset("tiny"), truncated, shards=1)
    shard = next(truncated.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100_000])
    cases["truncated shard"] = (["--model-path", str(truncated)], {},
                                f"error: {shard}: not a readable safetensors file")
    cases["prompt longer than the context"] = (
        ["--model-path", str(long_ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "5000"], {},
        "error: a prompt of 3 tokens plus --max-new-tokens 5000 needs 5003 positions; this "
        "model covers 4096")
    procs = {name: cli("generate", "--quiet", *args, env=clean_env(**env))
             for name, (args, env, _) in cases.items()}
    for name, proc in procs.items():
        out, err = finish(proc, rc=2)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(cases[name][2]), (name, err)
        assert "Traceback" not in err


def test_debug_shows_the_traceback():
    _, err = finish(cli("generate", "--batch", "0", "--debug"), rc=1)
    assert "Traceback" in err and "UsageError: --batch must be >= 1, got 0" in err
