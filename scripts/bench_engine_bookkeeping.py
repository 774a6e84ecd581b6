"""Host bookkeeping of the decode engine per step, at short and long context.

For each context length, one request of that many prompt tokens is prefilled, then decoded for
--steps steps (tiny preset, random weights, eager). Per decode step it reports:
  bookkeeping_us_p50   the step's wall time minus its model forward (allocation, block table,
                       SWA eviction, sampling, request state),
  elements_per_step    location elements the engine passes to the allocator (alloc_decode,
                       free_swa_out_of_window, free_swa, free), per step: the work that would
                       grow with context if the engine rescanned a request's history.
Steps 2 to n-1 are reported: the first is a warm-up and the last also frees the finished
request, once per request.
The derived ratios (longest / shortest context) are the figure of merit: 1.0 means the per-step
host work does not grow with context. On a GPU the times include the device syncs the engine's
host reads cost.

JSON (--out): the common record keys (see bench_common), "results": one row per context_len
{context_len, steps, bookkeeping_us_p50, bookkeeping_us_mean, forward_ms_p50,
elements_per_step}, and "ratios": {bookkeeping_time, elements} of the longest context to the
shortest.
"""

from __future__ import annotations

import statistics
import time

import torch

import bench_common as bc
from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.model import DeepseekV4Model
from dsv4.random_init import init_random_weights

COUNTED = ("alloc_decode", "free_swa_out_of_window", "free_swa", "free")


def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return len(value)
    return 0


def instrument(engine: Engine) -> dict:
    """Count the location elements given to the allocator and time each model forward."""
    counts = {"elements": 0, "forward_s": []}
    allocator = engine.allocator
    for name in COUNTED:
        original = getattr(allocator, name)

        def counted(*args, _original=original, **kwargs):
            counts["elements"] += sum(_numel(a) for a in args) + sum(
                _numel(v) for v in kwargs.values())
            return _original(*args, **kwargs)
        setattr(allocator, name, counted)
    forward = engine._decode_forward

    def timed(batch):
        start = time.perf_counter()
        out = forward(batch)
        counts["forward_s"].append(time.perf_counter() - start)
        return out
    engine._decode_forward = timed
    return counts


def run_context(model, context_len: int, steps: int, page_size: int) -> dict:
    engine = Engine(model, max_batch=1, page_size=page_size,
                    max_context_len=context_len + steps + 1, graph=False)
    counts = instrument(engine)
    g = torch.Generator().manual_seed(context_len)
    prompt = torch.randint(2, model.config.vocab_size, (context_len,), generator=g).tolist()
    elements_after_prefill = []

    def on_step():
        elements_after_prefill.append(counts["elements"])
    with torch.no_grad():
        engine.generate([prompt], steps + 1, on_step=on_step)
    # Steps 2..n-1: the first is a warm-up, the last also releases the finished request (a
    # per-request cost, paid once).
    step_s = engine.stats.decode_step_s
    book = [(s - f) * 1e6 for s, f in zip(step_s, counts["forward_s"])][1:-1]
    per_step = [b - a for a, b in zip(elements_after_prefill, elements_after_prefill[1:])][:-1]
    return {"context_len": context_len, "steps": len(book),
            "bookkeeping_us_p50": round(statistics.median(book), 2),
            "bookkeeping_us_mean": round(statistics.fmean(book), 2),
            "forward_ms_p50": round(statistics.median(counts["forward_s"]) * 1e3, 3),
            "elements_per_step": round(statistics.fmean(per_step), 2)}


def parse_args(argv=None):
    p = bc.parser(__doc__.split("\n")[0], "results/bench_engine_bookkeeping.json",
                  repetitions=False)
    p.add_argument("--contexts", type=bc.int_list, default=None,
                   help="prompt lengths (default 256,4096; quick 256,1024)")
    p.add_argument("--steps", type=int, default=None,
                   help="decode steps per context (default 64; quick 24)")
    p.add_argument("--page-size", type=int, default=256, help="page size in tokens (256)")
    args = p.parse_args(argv)
    bc.resolve_repetitions(args)
    args.contexts = args.contexts or ([256, 1024] if args.quick else [256, 4096])
    args.steps = args.steps or (24 if args.quick else 64)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = {"preset": "tiny", "contexts": args.contexts, "steps": args.steps,
              "page_size": args.page_size, "threads": args.threads}
    record = bc.new_record("bench_engine_bookkeeping", args, config)
    model = init_random_weights(DeepseekV4Model(ModelConfig.preset("tiny"), max_seq_len=max(
        args.contexts) + args.steps + 2), seed=0).to(bc.device())
    rows = []
    with bc.progress(len(args.contexts), "engine bookkeeping", args.no_progress) as bar:
        for n in args.contexts:
            rows.append(run_context(model, n, args.steps, args.page_size))
            bar.update()
    record["results"] = rows
    short, long = rows[0], rows[-1]
    record["ratios"] = {
        "bookkeeping_time": round(long["bookkeeping_us_p50"] / short["bookkeeping_us_p50"], 3),
        "elements": round(long["elements_per_step"] / max(short["elements_per_step"], 1e-9), 3)}
    bc.write_json(args.out, record)
    for r in rows:
        print(f"context {r['context_len']:>5}: bookkeeping {r['bookkeeping_us_p50']} us/step "
              f"(p50), {r['elements_per_step']} location elements/step, forward "
              f"{r['forward_ms_p50']} ms")
    print(f"long/short: time {record['ratios']['bookkeeping_time']}x, elements "
          f"{record['ratios']['elements']}x; wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
