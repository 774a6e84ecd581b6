"""Where a replayed decode graph's time goes, against the eager step, on the device present.

One decode step of the tiny preset (batch 1, a --prompt-len prompt) is timed three ways:
  eager            the model as the engine runs it eagerly (compressed rows up to the batch's
                   longest request, compressor windows pooled only where one closes)
  eager_static     the same step with a captured graph's shapes: compressed rows fixed by
                   max_context_len, every row pooling a compressor window (a graph's shapes
                   cannot depend on the step)
  replay           the captured graph (HIP graph on ROCm, the CPU emulation on a CPU)
replay / eager = (eager_static / eager: the cost of static shapes) x (replay / eager_static: the
cost of the replay mechanism). On a CPU the mechanism re-dispatches every recorded op from
Python; on a GPU a graph launch replaces all the step's launches.

JSON (--out): the common record keys (see bench_common), "results": {eager_ms, eager_static_ms,
replay_ms (medians), eager_ops, eager_static_ops, recorded_ops, replayed_ops, ratios:
{replay_vs_eager, static_shapes, mechanism}}.
"""

from __future__ import annotations

import statistics
import time

import torch

import bench_common as bc
from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.forward_batch import ForwardBatch, ForwardMode
from dsv4.graphs.decode_runner import decode_inputs
from dsv4.model import DeepseekV4Model
from dsv4.random_init import init_random_weights
from hip_kernels.checks import trusted_locations


def median_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        bc.synchronize()
        start = time.perf_counter()
        fn()
        bc.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def parse_args(argv=None):
    p = bc.parser(__doc__.split("\n")[0], "results/bench_graph_replay.json")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    args = p.parse_args(argv)
    bc.resolve_repetitions(args)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    context = args.prompt_len + 32
    config = {"preset": "tiny", "batch": 1, "prompt_len": args.prompt_len,
              "max_context_len": context}
    record = bc.new_record("bench_graph_replay", args, config)
    model = init_random_weights(DeepseekV4Model(ModelConfig.preset("tiny"),
                                                max_seq_len=context), seed=0).to(bc.device())
    engine = Engine(model, max_batch=1, max_context_len=context, graph=True)
    seen = {}
    decode_forward = engine._decode_forward

    def keep(batch):
        seen["batch"] = batch
        return decode_forward(batch)
    engine._decode_forward = keep
    prompt = torch.randint(2, model.config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    engine.generate([prompt], 3)            # captures, then replays two steps
    b = seen["batch"]
    static = ForwardBatch(ForwardMode.DECODE, b.input_ids, b.positions, b.out_cache_loc,
                          b.req_pool_indices, b.seq_lens)
    max_rows = model.static_max_rows(context)

    def eager():
        with trusted_locations():
            model(b, engine.pool, engine.req_to_token, options=engine.options)

    def eager_static():
        with trusted_locations():
            model(static, engine.pool, engine.req_to_token, max_rows=max_rows,
                  options=engine.options)

    runner, inputs = engine.graph_runner, decode_inputs(b)

    def replay():
        runner.replay(inputs, engine.options)
    times = {name: median_ms(fn, args.warmup, args.reps)
             for name, fn in (("eager", eager), ("eager_static", eager_static),
                              ("replay", replay))}
    recorded = getattr(runner.graphs[1], "ops", None)
    result = {f"{k}_ms": round(v, 3) for k, v in times.items()}
    result.update({
        "eager_ops": bc.count_launches(eager).launches,
        "eager_static_ops": bc.count_launches(eager_static).launches,
        "recorded_ops": len(recorded) if recorded is not None else None,
        "replayed_ops": sum(op.rerun for op in recorded) if recorded is not None else None,
        "ratios": {"replay_vs_eager": round(times["replay"] / times["eager"], 3),
                   "static_shapes": round(times["eager_static"] / times["eager"], 3),
                   "mechanism": round(times["replay"] / times["eager_static"], 3)}})
    record["results"] = result
    bc.write_json(args.out, record)
    r = result["ratios"]
    print(f"eager {result['eager_ms']} ms ({result['eager_ops']} ops); with a graph's shapes "
          f"{result['eager_static_ms']} ms ({result['eager_static_ops']} ops); replay "
          f"{result['replay_ms']} ms ({result['replayed_ops']} of {result['recorded_ops']} "
          f"recorded ops re-run)")
    print(f"replay / eager {r['replay_vs_eager']}x = static shapes {r['static_shapes']}x x "
          f"replay mechanism {r['mechanism']}x; wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
