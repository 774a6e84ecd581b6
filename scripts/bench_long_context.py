"""Prefill throughput, peak memory and decode step latency of one request against its length.

Each prompt length (--prompt-lens) runs in a fresh worker process, so that its peak memory is its
own: the worker builds the model (``bench_model.py``: the tiny preset unless --preset says
otherwise, seeded random weights), makes a ``dsv4.engine.Engine`` for one request of that length
(eager unless --graph; --prefill-chunk N, default 0: sized from the device's memory, as the
engine does), warms it up with a 16-token prompt (lazy initialisation, graph capture), then
generates --max-new-tokens tokens after one random prompt of that length. The engine's own
counters give the times (``EngineStats``): the wall time of each prefill step (the chunks of the
prompt, the first token's sampling included) and of each decode step (allocation, forward,
sampling). The sampled tokens are read on the host every step, so on a GPU host times bound the
device's work.

Memory: on a CPU the worker's peak resident set (``ru_maxrss``: the model, the warm-up and the
run), and its resident set before the measured run; on a GPU, also
``torch.cuda.max_memory_allocated`` over the measured run and what was allocated before it
(weights, KV pool).

The HBM floor of a decode step: the bytes it cannot avoid moving, the native active weight bytes
of a batch-1 step (``weight_reads.py``: the published FP8/FP4 formats, the experts the token is
routed to; counted once, in this process, after the sweep) plus the KV rows the first decode step
reads and writes at that context (``decode_launches.kv_bytes``: the window, the indexer's top-k
of the ratio-4 rows and all their indexer keys, all the ratio-128 rows), divided by the device's
peak HBM bandwidth (``bench_set_kv.PEAK_HBM``, or --hbm-bandwidth). Without a bandwidth (a CPU,
an unknown GPU) the bytes are given and floor_ms is null.

Output JSON (beyond bench_common's record keys):
  "machine": the GPU's name, else the CPU's model
  "model": bench_model's description (preset, layers, experts, parameters, weights, note)
  "hbm_bytes_per_s": the bandwidth the floor assumes (null: none)
  "weight_bytes_per_step": native active weight bytes of a batch-1 decode step
  "results": one row per prompt length: prompt_len, new_tokens, prefill_chunk (the engine's),
      prefill_steps, prefill_ms (sum of the prefill steps), prefill_ms_per_token,
      prefill_tokens_per_s, ttft_ms (generate's start to the first token), decode_steps,
      decode_ms_p50, decode_ms_p90, decode_ms_max, decode_step_ms (each step's), graph_used,
      kv_pool_bytes (the engine's pool), rss_before_bytes, peak_rss_bytes, device_before_bytes,
      peak_device_bytes (null on a CPU), kv_read_bytes, kv_written_bytes, floor_bytes,
      floor_ms, decode_vs_floor (p50 over the floor; null without a floor), worker_s (the
      worker's wall time, model build included)
  "errors": [{"prompt_len", "error"}] for points whose worker failed or ran out of time
  "notes": caveats of this run

--markdown prints the table as markdown (for docs/benchmarks.md); --plot PATH writes a PNG:
prefill tokens/s and peak memory against the prompt length, decode step p50 (and its floor)
against the context (``plot_results.plot_long_context``).

Run: python scripts/bench_long_context.py [--prompt-lens 1024,2048,...,65536] [--plot F.png]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import bench_common as bc
import decode_launches
import weight_reads
from bench_model import add_model_args, build_model
from bench_set_kv import peak_hbm_bytes_per_s

RESULT = "RESULT "
WARMUP_PROMPT = 16      # tokens of the warm-up prompt
GIB = 2 ** 30


# ---- worker: one prompt length, in its own process -------------------------------------------


def rss_bytes() -> int | None:
    """This process's resident set now (Linux /proc; None elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def decode_ms(seconds: list[float]) -> dict:
    """decode_ms_p50, _p90 (nearest rank) and _max of the decode steps' wall times, and each
    step's (decode_step_ms, in order)."""
    if not seconds:
        return {**dict.fromkeys(("decode_ms_p50", "decode_ms_p90", "decode_ms_max")),
                "decode_step_ms": []}
    t = bc.Timing([v * 1e3 for v in seconds], "perf_counter")   # ms values: only percentiles
    return {"decode_ms_p50": round(t.p50, 3), "decode_ms_p90": round(t.p90, 3),
            "decode_ms_max": round(max(t.samples_us), 3),
            "decode_step_ms": [round(v, 3) for v in t.samples_us]}


def run_point(spec: dict) -> dict:
    """One prompt of spec["prompt_len"] tokens through a fresh engine (module docstring)."""
    from dsv4.engine import Engine, EngineStats

    began = time.perf_counter()
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    n = spec["prompt_len"]
    model, _ = build_model({**spec, "contexts": [n]})
    engine = Engine(model, max_batch=1, max_context_len=n + spec["new_tokens"],
                    graph=spec["graph"], prefill_chunk=spec["prefill_chunk"])
    g = torch.Generator().manual_seed(spec["seed"] + n)
    vocab = model.config.vocab_size
    engine.generate([torch.randint(2, vocab, (WARMUP_PROMPT,), generator=g).tolist()], 2)
    prompt = torch.randint(2, vocab, (n,), generator=g).tolist()
    gpu = bc.on_gpu()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    engine.stats = EngineStats()
    rss_before = rss_bytes()
    device_before = torch.cuda.memory_allocated() if gpu else None
    out = engine.generate([prompt], spec["new_tokens"])
    if out.errors[0]:
        raise RuntimeError(out.errors[0])
    s = engine.stats
    prefill_s = sum(s.prefill_s)
    return {
        "prompt_len": n, "new_tokens": spec["new_tokens"], "prefill_chunk": engine.prefill_chunk,
        "prefill_steps": len(s.prefill_s), "prefill_ms": round(prefill_s * 1e3, 3),
        "prefill_ms_per_token": round(prefill_s * 1e3 / n, 4),
        "prefill_tokens_per_s": round(n / prefill_s, 2),
        "ttft_ms": round(s.first_token_s * 1e3, 3),
        "decode_steps": len(s.decode_step_s),
        **decode_ms(s.decode_step_s),
        "graph_used": s.graph_steps > 0,
        "kv_pool_bytes": engine.pool.nbytes,
        "rss_before_bytes": rss_before, "peak_rss_bytes": peak_rss_bytes(),
        "device_before_bytes": device_before,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if gpu else None,
        "worker_s": round(time.perf_counter() - began, 2),
    }


def worker(spec: dict) -> None:
    """Print one RESULT line (stdout, JSON)."""
    with torch.no_grad():
        row = run_point(spec)
    print(RESULT + json.dumps(row), flush=True)


# ---- parent: one worker per prompt length ----------------------------------------------------


def run_worker(spec: dict, timeout: float | None) -> dict:
    """The worker's row, or {"prompt_len", "error"}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"prompt_len": spec["prompt_len"], "error": f"ran past --point-timeout {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    return {"prompt_len": spec["prompt_len"],
            "error": f"worker exited with {proc.returncode}: {proc.stderr[-2000:]}"}


def step_weights(spec: dict) -> tuple[dict, object, int]:
    """(bench_model's description, the config, the native active weight bytes of a batch-1
    decode step): after a short prompt, as a batch-1 step reads the same weights at any
    context."""
    model, info = build_model({**spec, "contexts": [WARMUP_PROMPT], "new_tokens": 3})
    with torch.no_grad():
        count = weight_reads.count_decode_step(model, 1, WARMUP_PROMPT, spec["seed"])
    return info, model.config, count["native_active_bytes"]


def add_floor(row: dict, config, weight_bytes: int, bandwidth: float | None) -> None:
    """The row's KV bytes, floor bytes, floor_ms and decode_vs_floor (module docstring)."""
    kv = decode_launches.kv_bytes(config, 1, row["prompt_len"] + 1)   # the first decode step
    floor_bytes = weight_bytes + kv["kv_read_bytes"] + kv["kv_written_bytes"]
    floor = decode_launches.floor_ms(floor_bytes, bandwidth)
    p50 = row["decode_ms_p50"]
    row.update(kv, floor_bytes=floor_bytes, floor_ms=floor,
               decode_vs_floor=round(p50 / floor, 2) if floor and p50 else None)


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


COLUMNS = (   # (header, row -> text, only when some row has the key set)
    ("prompt tokens", lambda r: f"{r['prompt_len']:,}", None),
    ("chunk", lambda r: f"{r['prefill_chunk']:,}", None),
    ("prefill s", lambda r: number(r["prefill_ms"] / 1e3, 1), None),
    ("prefill ms/token", lambda r: number(r["prefill_ms_per_token"], 2), None),
    ("prefill tokens/s", lambda r: number(r["prefill_tokens_per_s"], 1), None),
    ("decode step p50 ms", lambda r: number(r["decode_ms_p50"], 1), None),
    ("peak RSS GiB", lambda r: gib(r["peak_rss_bytes"]), None),
    ("peak device GiB", lambda r: gib(r["peak_device_bytes"]), "peak_device_bytes"),
    ("floor MB", lambda r: number(r["floor_bytes"] / 1e6, 2), None),
    ("floor ms", lambda r: number(r["floor_ms"], 3), "floor_ms"),
    ("p50 / floor", lambda r: number(r["decode_vs_floor"], 1), "decode_vs_floor"),
)


def table(rows: list[dict], markdown: bool) -> list[str]:
    """The results as text lines: aligned columns, or a markdown table."""
    cols = [(h, f) for h, f, key in COLUMNS if key is None or any(r[key] is not None
                                                                  for r in rows)]
    cells = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        return lines[:1] + ["|" + "---|" * len(cols)] + lines[1:]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]


def notes(bandwidth: float | None) -> list[str]:
    out = []
    if bandwidth:
        out.append(f"floor_ms assumes {bandwidth / 1e12:g} TB/s of HBM bandwidth")
    else:
        out.append("no HBM bandwidth here (a CPU or an unknown GPU; --hbm-bandwidth sets one): "
                   "floor bytes only")
    if not bc.on_gpu():
        out.append("CPU: times are the torch reference path's on this machine, shared with "
                   "other jobs; they say nothing about a GPU")
    return out



def parse_args(argv=None):
    gpu = bc.on_gpu()
    p = bc.parser(__doc__.split("\n")[0], "results/bench_long_context.json", repetitions=False)
    p.add_argument("--prompt-lens", type=bc.int_list, default=None,
                   help="prompt lengths, one worker each (default 1024,2048 on a CPU, "
                        "1024,4096,16384,65536 on a GPU; quick 128,256)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens generated after each prompt: the first from the prefill, the "
                        "rest one decode step each (default 4; quick 3)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="the engine's prefill chunk in tokens (default 0: sized from the "
                        "device's memory)")
    p.add_argument("--graph", action="store_true",
                   help="replay decode steps from captured graphs (default: eager)")
    add_model_args(p, "tiny", "model preset (default tiny)",
                   "keep only the first N layers (default: all)")
    p.add_argument("--hbm-bandwidth", type=float, default=None,
                   help="HBM bandwidth the floor assumes, TB/s (default: the GPU's peak from "
                        "bench_set_kv.PEAK_HBM; none on a CPU)")
    p.add_argument("--point-timeout", type=float, default=None,
                   help="seconds a worker may run before it is stopped and its point recorded "
                        "as an error (default: no limit)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--plot", type=Path, default=None, help="write the figure to this PNG")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return args
    args.prompt_lens = args.prompt_lens or ([128, 256] if args.quick else
                                            [1024, 4096, 16384, 65536] if gpu else [1024, 2048])
    if args.max_new_tokens is None:
        args.max_new_tokens = 3 if args.quick else 4
    if min(args.prompt_lens) < 1:
        p.error(f"--prompt-lens must be >= 1, got {min(args.prompt_lens)}")
    if args.max_new_tokens < 2:
        p.error(f"--max-new-tokens must be >= 2 (one decode step at least), got "
                f"{args.max_new_tokens}")
    if args.prefill_chunk < 0:
        p.error(f"--prefill-chunk must be >= 0 (0: sized from the device), got "
                f"{args.prefill_chunk}")
    if args.hbm_bandwidth is not None and args.hbm_bandwidth <= 0:
        p.error(f"--hbm-bandwidth must be > 0 TB/s, got {args.hbm_bandwidth}")
    bc.resolve_repetitions(args)
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return None
    spec = {"preset": args.preset, "layers": args.layers, "experts": args.experts,
            "vocab": args.vocab, "weights": args.weights, "init": args.init,
            "new_tokens": args.max_new_tokens, "graph": args.graph,
            "prefill_chunk": args.prefill_chunk, "seed": args.seed, "threads": args.threads}
    record = bc.new_record("bench_long_context", args, {**spec, "prompt_lens": args.prompt_lens})
    bandwidth = (args.hbm_bandwidth * 1e12 if args.hbm_bandwidth is not None
                 else peak_hbm_bytes_per_s())
    rows, errors = [], []
    with bc.progress(len(args.prompt_lens), "prompts", args.no_progress) as bar:
        for n in args.prompt_lens:
            bar.set_postfix_str(f"{n} tokens")
            row = run_worker({**spec, "prompt_len": n}, args.point_timeout)
            (errors if "error" in row else rows).append(row)
            bar.update()
    info, config, weight_bytes = step_weights(spec)
    for row in rows:
        add_floor(row, config, weight_bytes, bandwidth)
    record.update(machine=bc.machine_name(), model=info, hbm_bytes_per_s=bandwidth,
                  weight_bytes_per_step=weight_bytes, results=rows, errors=errors,
                  notes=notes(bandwidth))
    bc.write_json(args.out, record)
    mode = "graphs" if args.graph else "eager"
    print(f"{record['machine']}, {info['note']}, one request, {args.max_new_tokens} new tokens, "
          f"{mode}, commit {(record['env']['git_commit'] or 'unknown')[:10]}")
    print("\n".join(table(rows, args.markdown)))
    for e in errors:
        print(f"error: {e['prompt_len']} tokens: {e['error']}")
    for note in record["notes"]:
        print(f"note: {note}")
    if args.plot is not None:
        import plot_results

        plot_results.plot_long_context_file(record, args.plot)
    print(f"wrote {args.out} ({len(rows)} points, {len(errors)} errors)")
    return record


if __name__ == "__main__":
    main()
