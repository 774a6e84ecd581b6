"""Prefill time saved by the prefix cache, against the fraction of the prompt it holds.

For each shared fraction f, --batch prompts of --prompt-len tokens is run twice on an
engine with a prefix cache: a warm pass with prompts base_i, then the measured pass with
prompts that keep the first f * prompt-len tokens of base_i and continue with fresh tokens. The
same measured prompts also run on an engine without a cache. Only whole pages are reused, and a
prompt's last token is always computed, so the achieved hit rate steps with the page size.
Each repetition starts from an empty cache (a measured prompt would otherwise hit its own
pages); the prefill time reported is the median over repetitions (tiny preset, random weights,
eager).

JSON (--out): the common record keys (see bench_common), "results": one row per fraction
{shared_fraction, hit_rate, hit_tokens, prompt_tokens, prefill_ms_cached, prefill_ms_uncached,
saved_fraction, same_tokens}. same_tokens: the first generated token of every prompt equals the
uncached run's. Plot: python scripts/plot_results.py DIR (prefix_cache.png).
"""

from __future__ import annotations

import statistics

import torch

import bench_common as bc
from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.model import DeepseekV4Model
from dsv4.random_init import init_random_weights
from mem_pool.prefix import PrefixCache


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, ModelConfig.preset("tiny").vocab_size, (batch, length),
                         generator=g).tolist()


def prefill_ms(engine: Engine, batch: list[list[int]]) -> tuple[float, list[list[int]]]:
    engine.stats.prefill_s.clear()
    out = engine.generate(batch, 1)
    return sum(engine.stats.prefill_s) * 1e3, out.tokens


def run_fraction(model, args, fraction: float) -> dict:
    base = prompts(args.batch, args.prompt_len, seed=1)
    fresh = prompts(args.batch, args.prompt_len, seed=2)
    shared = int(fraction * args.prompt_len)
    measured = [b[:shared] + f[shared:] for b, f in zip(base, fresh)]

    def engine(cache):
        return Engine(model, page_size=args.page_size, max_batch=args.batch,
                      max_context_len=args.prompt_len + 1, graph=False, prefix_cache=cache)
    plain = engine(False)
    prefill_ms(plain, measured)                                  # warm-up
    cached_ms, uncached_ms, same = [], [], True
    for _ in range(args.reps):
        uncached, want = prefill_ms(plain, measured)
        cache = PrefixCache(args.page_size, model.config.window_size,
                            host_capacity_pages=4 * args.batch * -(-args.prompt_len
                                                                  // args.page_size))
        e = engine(cache)
        prefill_ms(e, base)                                      # the warm pass
        e.stats.prompt_tokens = e.stats.prefix_hit_tokens = 0
        ms, got = prefill_ms(e, measured)
        cached_ms.append(ms)
        uncached_ms.append(uncached)
        same = same and got == want
    cached, uncached = statistics.median(cached_ms), statistics.median(uncached_ms)
    return {"shared_fraction": fraction, "hit_rate": round(e.stats.prefix_hit_rate, 4),
            "hit_tokens": e.stats.prefix_hit_tokens, "prompt_tokens": e.stats.prompt_tokens,
            "prefill_ms_cached": round(cached, 3), "prefill_ms_uncached": round(uncached, 3),
            "saved_fraction": round(1 - cached / uncached, 4), "same_tokens": same}


def parse_args(argv=None):
    p = bc.parser(__doc__.split("\n")[0], "results/bench_prefix_cache.json",
                  repetitions=False)
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions per fraction, median reported (default 3; quick 1)")
    p.add_argument("--fractions", type=lambda t: [float(x) for x in t.split(",")],
                   default=None, help="shared prefix fractions (default 0,0.25,0.5,0.75,1; quick 0,0.5,1)")
    p.add_argument("--batch", type=int, default=1, help="prompts per pass (default 1)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="tokens per prompt (default 1024; quick 256)")
    p.add_argument("--page-size", type=int, default=None,
                   help="page size in tokens (default 256; quick 128)")
    args = p.parse_args(argv)
    # Before the shared defaults, which would give --reps the timing scripts' 50.
    args.reps = args.reps or (1 if args.quick else 3)
    bc.resolve_repetitions(args)
    args.fractions = args.fractions or ([0.0, 0.5, 1.0] if args.quick
                                        else [0.0, 0.25, 0.5, 0.75, 1.0])
    args.prompt_len = args.prompt_len or (256 if args.quick else 1024)
    args.page_size = args.page_size or (128 if args.quick else 256)
    bad = [f for f in args.fractions if not 0 <= f <= 1]
    if bad:
        p.error(f"--fractions must lie in 0..1, got {bad}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = {"preset": "tiny", "fractions": args.fractions, "batch": args.batch,
              "prompt_len": args.prompt_len, "page_size": args.page_size,
              "repetitions": args.reps, "threads": args.threads}
    record = bc.new_record("bench_prefix_cache", args, config)
    model = init_random_weights(DeepseekV4Model(ModelConfig.preset("tiny"),
                                                max_seq_len=args.prompt_len + 2), seed=0)
    model = model.to(bc.device())
    rows = []
    with bc.progress(len(args.fractions), "prefix cache", args.no_progress) as bar:
        for fraction in args.fractions:
            rows.append(run_fraction(model, args, fraction))
            bar.update()
    record["results"] = rows
    bc.write_json(args.out, record)
    for r in rows:
        print(f"shared {r['shared_fraction']:.0%}: hit rate {r['hit_rate']:.1%}, prefill "
              f"{r['prefill_ms_cached']} ms with the cache vs {r['prefill_ms_uncached']} ms "
              f"without (saved {r['saved_fraction']:.1%}); same tokens: {r['same_tokens']}")
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
