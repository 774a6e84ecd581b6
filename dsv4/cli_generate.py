"""`python -m dsv4 generate`: prompts in, generated tokens and a speed report out (the report
separates the prefill, time to first token, from the decode). Its options, report and errors are
described in docs/cli.md.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .cli_errors import UsageError

if TYPE_CHECKING:
    from .engine import EngineStats

IDS_LINE = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*$")


def parse_ids(text: str, what: str) -> list[int]:
    if not IDS_LINE.match(text):
        raise UsageError(f"{what} must be comma-separated token ids like 1,2,3, got {text!r}")
    return [int(t) for t in text.split(",")]


def load_tokenizer(model_path: str | None):
    """The checkpoint's tokenizer.json as a `tokenizers.Tokenizer`, or None when there is none."""
    if not model_path or not (Path(model_path) / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(f"{model_path}/tokenizer.json needs the `tokenizers` package: "
                         "pip install tokenizers") from None
    return Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))


def _encode(tokenizer, text: str, what: str) -> list[int]:
    if tokenizer is None:
        raise UsageError(f"{what} is text and needs a tokenizer: give --model-path DIR with a "
                         "tokenizer.json (the built-in presets have none), or token ids")
    return tokenizer.encode(text, add_special_tokens=False).ids


def prompts_from_args(args, tokenizer, vocab_size: int) -> list[list[int]]:
    if args.prompt is not None:
        prompts = [_encode(tokenizer, args.prompt, "--prompt")]
    elif args.prompt_ids is not None:
        prompts = [parse_ids(args.prompt_ids, "--prompt-ids")]
    elif args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UsageError(f"--prompt-file {path}: no such file")
        lines = [(f"{path} line {i + 1}", line)        # blank lines skipped, still counted
                 for i, line in enumerate(path.read_text().splitlines()) if line.strip()]
        if not lines:
            raise UsageError(f"--prompt-file {path} holds no prompt")
        prompts = [parse_ids(line, where) if IDS_LINE.match(line) else
                   _encode(tokenizer, line, where) for where, line in lines]
    else:
        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(2, vocab_size, (args.batch, random_prompt_len(args)),
                             generator=g).tolist()
    for p in prompts:
        bad = [t for t in p if t >= vocab_size]
        if not p or bad:
            raise UsageError(f"a prompt must hold 1 or more ids below the vocabulary size "
                             f"{vocab_size}, got {len(p)} ids, out of range: {bad[:5]}")
    return prompts


def random_prompt_len(args) -> int:
    if args.prompt_len is not None:
        return args.prompt_len
    return 300 if args.prefix_cache else 32


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def build_report(s: EngineStats, device: str, graph_backend: str | None,
                 pool_tokens: tuple[int, int], wall_s: float, tokens: list[list[int]],
                 errors: list[str | None]) -> dict:
    """The run's report from an engine's counters ``s``, the device, the graph backend (None:
    no graphs) and the pool's (full, SWA) token capacity."""
    full_tokens, swa_tokens = pool_tokens
    steps = sorted(t * 1e3 for t in s.decode_step_s)
    eager = s.eager_steps
    decode_s = sum(s.decode_step_s)
    return {
        "device": str(device),
        "tokens": tokens,
        "errors": errors,
        "graph": s.graph_steps > 0,
        "graph_backend": graph_backend,
        "ttft_ms": round(s.first_token_s * 1e3, 3),
        "decode_steps": len(steps),
        "decode_tokens_per_s": round(s.decode_tokens / decode_s, 3) if steps else None,
        "step_latency_ms_p50": round(_percentile(steps, 0.5), 3) if steps else None,
        "step_latency_ms_p90": round(_percentile(steps, 0.9), 3) if steps else None,
        "tokens_per_s": round(sum(len(t) for t in tokens) / wall_s, 3),
        # Replayed graphs gather inside the graph: the pool's counters only see eager steps.
        "swa_translations_per_step": round(s.eager_swa_translations / eager, 3) if eager else None,
        "swa_cache_hits_per_step": round(s.eager_swa_hits / eager, 3) if eager else None,
        "pool_usage": {"full_tokens_peak": s.peak_full_tokens, "full_tokens": full_tokens,
                       "swa_tokens_peak": s.peak_swa_tokens, "swa_tokens": swa_tokens,
                       "peak_fraction": round(s.peak_full_tokens / full_tokens, 4)},
        "retractions": s.retractions,
    }


def pass_report(i: int, s: EngineStats, tokens: list[list[int]]) -> dict:
    return {"pass": i, "prefix_hit_rate": round(s.prefix_hit_rate, 4),
            "prefix_hit_tokens": s.prefix_hit_tokens, "prompt_tokens": s.prompt_tokens,
            "prefill_ms": round(sum(s.prefill_s) * 1e3, 3), "tokens": tokens}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def print_report(r: dict, n_prompts: int, tokenizer, model_path: str | None = None) -> None:
    na = "n/a (graph replay: the gather runs inside the graph; counters move only at capture)"
    graph = (f"yes ({r['graph_backend']})" if r["graph"] else
             f"no (eager: {r['eager_reason']})" if r.get("eager_reason") else "no (eager)")
    for i, (ids, error) in enumerate(zip(r["tokens"], r["errors"])):
        print(f"request {i}: {len(ids)} tokens: {' '.join(map(str, ids))}")
        if error:
            print(f"  failed: {error}")
        if tokenizer is not None:
            print(f"  text: {tokenizer.decode(ids)!r}")
    if tokenizer is None:
        print(f"(no tokenizer: {model_path} has no tokenizer.json; token ids only)" if model_path
              else "(no tokenizer: the built-in presets have none; --model-path DIR with a "
              "tokenizer.json prints text)")
    print(f"generated {_count(sum(map(len, r['tokens'])), 'token')} for "
          f"{_count(n_prompts, 'prompt')} on {r['device']}; graphs: {graph}")
    print(f"weights: {r['weights']} ({r['weights_reason']})")
    if r.get("tp", 1) > 1:
        print(f"tensor parallel: {r['tp']} ranks, {r['weight_bytes_per_rank'] / 2 ** 30:.3f} GiB "
              "of weights per rank")
    print(f"prefill: time to first token {r['ttft_ms']} ms; chunks of at most "
          f"{_chunk_text(r['prefill_chunk'], r['prefill_chunk_source'])}")
    if r["decode_steps"]:
        print(f"decode: {r['decode_tokens_per_s']} tokens/s; step latency p50 "
              f"{r['step_latency_ms_p50']} ms, p90 {r['step_latency_ms_p90']} ms over "
              f"{r['decode_steps']} steps")
    else:
        print("decode: no decode step (every request ended at its first token)")
    print(f"end to end: {r['tokens_per_s']} tokens/s (prefill included)")
    for key, label in (("swa_translations_per_step", "SWA translations per decode step"),
                       ("swa_cache_hits_per_step", "SWA location cache hits per decode step")):
        value = r[key] if r[key] is not None else na if r["graph"] else "n/a (no decode step)"
        print(f"{label}: {value}")
    pool = r["pool_usage"]
    print(f"pool usage: peak {pool['full_tokens_peak']}/{pool['full_tokens']} full tokens "
          f"({pool['peak_fraction']:.1%}), peak {pool['swa_tokens_peak']}/{pool['swa_tokens']} "
          f"SWA tokens; retractions: {r['retractions']}")
    if len(r["passes"]) == 1 and not r["prefix_cache"]:
        return                               # one pass without a cache: said above
    for p in r["passes"]:
        same = "same tokens as pass 0" if p["tokens"] == r["passes"][0]["tokens"] else (
            "TOKENS DIFFER from pass 0")
        print(f"pass {p['pass']}: prefill {p['prefill_ms']} ms, prefix cache hit "
              f"{p['prefix_hit_tokens']}/{p['prompt_tokens']} prompt tokens "
              f"({p['prefix_hit_rate']:.1%}); {same}")


def _context_len(args, prompts: list[list[int]]) -> int:
    """The run's context length, once the prompts are known to fit the model's positions."""
    from .model import DeepseekV4Model

    context_len = max(map(len, prompts)) + args.max_new_tokens
    if args.model_path:   # load_model builds the model with the default position tables
        positions = inspect.signature(DeepseekV4Model).parameters["max_seq_len"].default
        if context_len > positions:
            raise UsageError(f"a prompt of {max(map(len, prompts))} tokens plus "
                             f"--max-new-tokens {args.max_new_tokens} needs {context_len} "
                             f"positions; this model covers {positions}")
    return context_len


def _estimate(args, config, prompts: list[list[int]], context_len: int, device, weights: str,
              chunk: int):
    """(one rank's estimate, the device's bytes, what to call the device, the prefill chunk:
    `chunk`, or when it is 0 the one ``auto_prefill_chunk`` sizes for the device)."""
    from .engine import PAGE_SIZE
    from .memory_estimate import GIB, auto_prefill_chunk, available_bytes, estimate, prefill_bytes

    if args.device_memory is not None:
        if args.device_memory <= 0:
            raise UsageError(f"--device-memory must be > 0 GiB, got {args.device_memory}")
        have, where = int(args.device_memory * GIB), f"a {args.device_memory:g} GiB device"
    else:
        have, where = available_bytes(device), str(device)
    need = estimate(config, len(prompts), context_len, PAGE_SIZE, weights=weights, tp=args.tp)
    chunk = chunk or auto_prefill_chunk(config, context_len, have, need.total_bytes, PAGE_SIZE,
                                        len(prompts), args.tp)
    need = replace(need, prefill_bytes=prefill_bytes(
        config, min(chunk, sum(map(len, prompts))), context_len, len(prompts), args.tp))
    return need, have, where, chunk


def _chunk_source(args, options) -> tuple[int, str]:
    """(the chunk asked for, 0 = auto; what asked for it)."""
    if args.prefill_chunk is not None:
        return args.prefill_chunk, "--prefill-chunk" if args.prefill_chunk else "auto"
    return options.prefill_chunk, "DSV4_PREFILL_CHUNK" if options.prefill_chunk else "auto"


def _check_fits(args, config, prompts: list[list[int]], context_len: int, device,
                weights: str, chunk: int) -> int:
    """Refuse a run whose estimate (weights held as ``weights``, one rank's part, prefill
    steps of the chunk) exceeds the device (nothing is allocated before this): the chunk."""
    from .memory_estimate import shortfall

    need, have, where, chunk = _estimate(args, config, prompts, context_len, device, weights,
                                         chunk)
    problem = shortfall(need, have, where)
    if problem and not args.force:
        raise UsageError(problem)
    return chunk


def print_estimate(args, config, prompts: list[list[int]], context_len: int, device,
                   weights: str, chunk: int, chunk_source: str) -> int:
    """--estimate-only: one rank's memory and whether it fits the device, nothing allocated."""
    from .memory_estimate import GIB

    need, have, where, chunk = _estimate(args, config, prompts, context_len, device, weights,
                                         chunk)
    fits = need.total_bytes <= have
    print(f"memory per rank (--tp {args.tp}, {weights} weights): {need.describe()}")
    print(f"fits {where} ({have / GIB:.1f} GiB): {'yes' if fits else 'no'}")
    print(f"prefill chunk: {_chunk_text(chunk, chunk_source)}")
    if args.json:
        print(json.dumps({"tp": args.tp, "weights": weights,
                          "weight_bytes_per_rank": need.weight_bytes, "kv_bytes": need.kv_bytes,
                          "total_bytes_per_rank": need.total_bytes, "device_bytes": have,
                          "fits": fits, "prefill_chunk": chunk}))
    return 0


def _chunk_text(chunk: int, source: str) -> str:
    return f"{chunk} tokens ({'sized from the device memory' if source == 'auto' else source})"


def weight_format(args, config) -> tuple[str, str]:
    """The format the run holds its weights in ("native" or "bf16") and why: by default native
    where the config allows it, for a checkpoint only when it stores quantized weights (as
    ``load_model`` chooses)."""
    from .weights.formats import native_problem

    problem = native_problem(config)
    if args.weights == "native" and problem:
        raise UsageError(f"--weights native: {problem}; use --weights bf16")
    if args.weights:
        return args.weights, f"--weights {args.weights}"
    if problem:
        return "bf16", f"default; native cannot run: {problem}"
    if args.model_path and not _stores_quantized(Path(args.model_path)):
        return "bf16", "default for a checkpoint of unquantized weights"
    return "native", "default: the published FP8/FP4 formats"


def _stores_quantized(path: Path) -> bool:
    from .weights.loader import checkpoint_files, read_headers, stores_quantized

    return stores_quantized(read_headers(checkpoint_files(path)))


def _config(args):
    from .config import ModelConfig

    if not args.model_path:
        return ModelConfig.preset(args.preset)
    path = Path(args.model_path)
    if not (path / "config.json").is_file():
        raise UsageError(f"--model-path {path}: no config.json there")
    return ModelConfig.from_json(path / "config.json")


def _model(args, config, weights: str, context_len: int, device, on_tensor, options, split):
    from . import DeepseekV4Model, init_random_weights, load_model

    if args.model_path:
        return load_model(args.model_path, device=device, on_tensor=on_tensor, options=options,
                          weights=weights, split=split)
    model = DeepseekV4Model(config, device=device, max_seq_len=context_len, options=options,
                            weights=weights, split=split)
    return init_random_weights(model, seed=args.seed)


def _prefix_cache(args, config, context_len: int, batch: int, options, group):
    """The engine's prefix_cache argument: None follows options.prefix_cache
    (DSV4_PREFIX_CACHE)."""
    if args.prefix_cache is None and args.prefix_cache_dir is None:
        return None
    if args.prefix_cache is False:
        return False
    from mem_pool.prefix import PrefixCache

    from .engine import PAGE_SIZE as page_size

    pages = batch * -(-context_len // page_size)
    file_dir = args.prefix_cache_dir or options.prefix_cache_dir or None
    return PrefixCache(page_size, config.window_size,
                       options.prefix_cache_host_pages or 4 * pages, file_dir=file_dir,
                       group=group)


def run(args) -> int:
    from tqdm import tqdm

    from .engine import Engine, EngineStats
    from .options import Options
    from .parallel import end_group, split_problem, start_group
    from .sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.threads or not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = _config(args)
    tokenizer = load_tokenizer(args.model_path)
    prompts = prompts_from_args(args, tokenizer, config.vocab_size)
    context_len = _context_len(args, prompts)
    weights, why = weight_format(args, config)
    problem = split_problem(config, args.tp, weights == "native")
    if problem:
        raise UsageError(problem)
    options = Options.from_env()          # the DSV4_* flags, read once for the model and engine
    chunk, chunk_source = _chunk_source(args, options)
    if args.estimate_only:
        return print_estimate(args, config, prompts, context_len, device, weights, chunk,
                              chunk_source)
    split = start_group(args.tp, os.environ, device)    # torchrun's RANK, WORLD_SIZE, ...
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    lead = split.rank == 0                  # rank 0 alone reports; the others print only errors

    def bar(desc, total=None):
        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True,
                    disable=True if args.quiet or not lead else None)

    chunk = _check_fits(args, config, prompts, context_len, device, weights, chunk)
    with bar("loading weights") as b:
        model = _model(args, config, weights, context_len, device, lambda: b.update(), options,
                       split)
    eos = None if args.ignore_eos else model.config.eos_token_id
    engine = Engine(model, max_batch=len(prompts), max_context_len=context_len,
                    eos_token_id=eos, graph=args.graph, options=options, prefill_chunk=chunk,
                    prefix_cache=_prefix_cache(args, model.config, context_len, len(prompts),
                                               options, split.group))
    cache, engine.prefix_cache = engine.prefix_cache, None   # the warm-up caches nothing
    with bar("warm-up and graph capture", total=1) as b:
        engine.generate(prompts, min(2, args.max_new_tokens), sampling=sampling)
        b.update()
    engine.prefix_cache = cache
    passes = []
    for i in range(args.repeat):
        engine.stats = EngineStats()
        with bar(f"pass {i}" if args.repeat > 1 else "decode",
                 total=args.max_new_tokens - 1) as b:
            start = time.perf_counter()
            out = engine.generate(prompts, args.max_new_tokens, on_step=b.update,
                                  sampling=sampling)
            wall = time.perf_counter() - start
        passes.append(pass_report(i, engine.stats, out.tokens))
    runner = engine.graph_runner
    report = build_report(engine.stats, engine.device, runner.backend.name if runner else None,
                          (engine.allocator.size_full, engine.allocator.size_swa), wall,
                          out.tokens, out.errors)
    report["weights"], report["weights_reason"] = weights, why
    report["prefix_cache"] = engine.prefix_cache is not None
    report["passes"] = passes
    report["tp"] = split.size
    report["weight_bytes_per_rank"] = sum(t.numel() * t.element_size() for t in (
        *model.parameters(), *model.buffers()))
    report["eager_reason"] = engine.eager_reason
    report["prefill_chunk"], report["prefill_chunk_source"] = engine.prefill_chunk, chunk_source
    if lead:
        print_report(report, len(prompts), tokenizer, args.model_path)
        if args.json:
            print(json.dumps(report))
    end_group(split)
    return 0
