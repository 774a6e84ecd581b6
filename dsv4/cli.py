"""Command line: `python -m dsv4 env` (flags) and `python -m dsv4 generate` (the main job)."""

from __future__ import annotations

import argparse
import sys


def _cmd_env(args: argparse.Namespace) -> int:
    from . import flags_table

    if args.markdown:
        print(flags_table.readme_table())
        return 0
    rows = flags_table.values_table()
    w = max(len(r[0]) for r in rows)
    vw = max(len(r[1]) for r in rows)
    print(f"{'flag':<{w}}  {'value':<{vw}}  source   meaning")
    for name, value, source, help_ in rows:
        print(f"{name:<{w}}  {value:<{vw}}  {source:<7}  {help_}")
    bad = any(r[1].startswith("ERROR") for r in rows)
    if not bad:
        from .plugins import sglang, vllm

        print("\nserving plugins (what each would replace in the installed engine):")
        for plugin in (sglang, vllm):
            print(f"  {plugin.status()}")
    return 1 if bad else 0


def _build_model(args: argparse.Namespace):
    import torch

    from . import ModelConfig, DeepseekV4Model, init_random_weights, load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model_path:
        return load_model(args.model_path, device=device)
    max_seq_len = args.prompt_len + args.max_new_tokens
    model = DeepseekV4Model(ModelConfig.preset(args.preset), device=device, max_seq_len=max_seq_len)
    return init_random_weights(model, seed=args.seed)


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _generate_report(engine, wall_s: float, new_tokens: int) -> dict:
    s, a = engine.stats, engine.allocator
    steps = sorted(t * 1e3 for t in s.decode_step_s)
    eager = s.eager_steps
    return {
        "device": str(engine.device),
        "graph": s.graph_steps > 0,
        "graph_backend": engine.graph_runner.backend.name if engine.graph_runner else None,
        "decode_steps": len(steps),
        "step_latency_ms_p50": round(_percentile(steps, 0.5), 3) if steps else None,
        "step_latency_ms_p90": round(_percentile(steps, 0.9), 3) if steps else None,
        "tokens_per_s": round(new_tokens / wall_s, 3),
        # Replayed graphs gather inside the graph: the pool's counters only see eager steps.
        "swa_translations_per_step": round(s.eager_swa_translations / eager, 3) if eager else None,
        "swa_cache_hits_per_step": round(s.eager_swa_hits / eager, 3) if eager else None,
        "pool_usage": {"full_tokens_peak": s.peak_full_tokens, "full_tokens": a.size_full,
                       "swa_tokens_peak": s.peak_swa_tokens, "swa_tokens": a.size_swa,
                       "peak_fraction": round(s.peak_full_tokens / a.size_full, 4)},
        "retractions": s.retractions,
    }


def _print_report(r: dict, args: argparse.Namespace) -> None:
    na = "n/a (graph replay: the gather runs inside the graph; counters move only at capture)"
    pool = r["pool_usage"]
    graph = f"yes ({r['graph_backend']})" if r["graph"] else "no (eager)"
    print(f"generated {args.batch} x {args.max_new_tokens} tokens on {r['device']}; graphs: {graph}")
    print(f"decode step latency: p50 {r['step_latency_ms_p50']} ms, p90 "
          f"{r['step_latency_ms_p90']} ms over {r['decode_steps']} steps")
    print(f"throughput: {r['tokens_per_s']} tokens/s (prefill included)")
    for key, label in (("swa_translations_per_step", "SWA translations per decode step"),
                       ("swa_cache_hits_per_step", "SWA location cache hits per decode step")):
        print(f"{label}: {na if r[key] is None else r[key]}")
    print(f"pool usage: peak {pool['full_tokens_peak']}/{pool['full_tokens']} full tokens "
          f"({pool['peak_fraction']:.1%}), peak {pool['swa_tokens_peak']}/{pool['swa_tokens']} "
          f"SWA tokens; retractions: {r['retractions']}")


def _cmd_generate(args: argparse.Namespace) -> int:
    import json
    import time

    import torch
    from tqdm import tqdm

    from .engine import Engine, EngineStats

    if args.threads or not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    model = _build_model(args)
    cfg = model.config
    engine = Engine(model, max_batch=args.batch, max_context_len=args.prompt_len
                    + args.max_new_tokens, eos_token_id=cfg.eos_token_id, graph=args.graph)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(2, cfg.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    engine.generate(prompts, 2)  # warm-up: lazy initialisation and graph capture
    engine.stats = EngineStats()
    with tqdm(total=args.max_new_tokens - 1, desc="decode", unit="step", file=sys.stderr,
              disable=None, leave=False) as bar:
        start = time.perf_counter()
        out = engine.generate(prompts, args.max_new_tokens, on_step=bar.update)
        wall = time.perf_counter() - start
    report = _generate_report(engine, wall, sum(len(t) for t in out.tokens))
    _print_report(report, args)
    if args.json:
        print(json.dumps(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsv4", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print every DSV4_* flag with its value and source")
    env.add_argument("--markdown", action="store_true", help="print the README table instead")
    env.set_defaults(func=_cmd_env)
    gen = sub.add_parser("generate", help="generate from random prompts and report decode speed "
                         "(default: tiny preset, seeded random weights)")
    gen.add_argument("--model-path", help="checkpoint directory (default: random weights)")
    gen.add_argument("--preset", default="tiny", help="model preset for random weights")
    gen.add_argument("--batch", type=int, default=4)
    gen.add_argument("--prompt-len", type=int, default=32)
    gen.add_argument("--max-new-tokens", type=int, default=16)
    gen.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                     help="capture and replay decode graphs (default: DSV4_GRAPH)")
    gen.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    gen.add_argument("--threads", type=int, default=0,
                     help="torch CPU threads (default: 1 on a CPU, where the tiny model's ops "
                     "are too small to share)")
    gen.add_argument("--json", action="store_true",
                     help="also print the report as one JSON object on the last line")
    gen.set_defaults(func=_cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
