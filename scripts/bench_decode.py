"""Decode ITL and tokens/s of the engine with each DSV4_* optimization flag on and off.

Each flag configuration runs in a fresh worker subprocess (flags are read once per process), which
builds the model once and sweeps concurrency x context length through `dsv4.engine.Engine`:
for each case it warms up (a short generate: lazy initialisation, graph capture), then times one
`generate(prompts, new_tokens)`. Workers start from the environment with every DSV4_* variable
removed (all defaults), then set their configuration's flags.

Configurations: "default" (no flag set), then one flag flipped at a time (DSV4_GRAPH=0,
DSV4_CACHE_SWA_TRANSLATION=0, DSV4_MULTI_STREAM_PREPARE=1, DSV4_FUSED_SWA_TRANSLATE=1), the
cache, multi-stream and fused-translation flips and DSV4_NUMERICS=fp32 in eager mode, and on a
GPU each DSV4_KERNEL_BACKEND (torch, triton, hip; on a CPU only the torch path runs, so those are
skipped). --quick runs the first four.

Model (``bench_model.py``): on a CPU the tiny preset (all its layers); on a GPU the flash preset
cut to --layers layers (default 4; Flash/Pro-shaped layers, seeded random weights), optionally
with fewer routed experts (--experts) and vocabulary rows (--vocab): the cut is stated in
"model". --weights: the format the sweep's model holds (default native where the config allows
it, else bf16; "model" says which). --init tiled: random weights from one seeded pool, the same
tensors and formats built in seconds (a Flash slice's seeded draws take minutes on a CPU).

Weight bytes (``weight_reads.py``, in this process, after the sweep): for each format the config
allows (native, bf16; --weight-reads picks), the weight bytes one eager decode step reads (the
first --concurrency and --contexts value) against the native active bytes of that step: a
count, not a time. The native active bytes come from the config and the step's routing, so a
bf16 model's row gives them too.

Timing: the engine runs one forward per decode step; a step's latency (the ITL sample) is the
time from the start of its forward to the start of the next one (the last: to the return of
generate), so sampling, allocation and eviction are included. The engine reads the sampled
tokens on the host every step, so host timestamps bound device work.

Output JSON (beyond bench_common's record keys):
  "model": preset, n_layers, n_layers_full, reduced, n_routed_experts, n_routed_experts_full,
      vocab_size, parameters, weights, init, note
  "weight_reads": one row per weight format: weights, concurrency, context_len, bytes_read,
      native_active_bytes, read_vs_native_active, kv_read_bytes, kv_written_bytes (the step's
      KV rows, ``decode_launches.kv_bytes``), floor_ms ((native active + KV bytes) at the
      device's peak HBM bandwidth: the step time no kernel can beat; null on a CPU or an unknown
      GPU), itl_vs_floor (the default configuration's itl_ms_p50 of the same batch and context
      over floor_ms; null without both)
  "configs": [{"name", "env"}]; "notes": caveats of this run
  "results": one row per (config, concurrency, context_len): config, env, concurrency,
      context_len, new_tokens, decode_steps, itl_ms_p50, itl_ms_p90, itl_ms_mean, prefill_ms,
      decode_tokens_per_s (concurrency * steps / decode time), e2e_tokens_per_s (all new tokens
      / generate wall time), swa_translations_per_step and swa_cache_hits_per_step (the pool's
      counters; null when graphs were replayed: the gathers then run inside the graph, see
      bench_swa_translation for the captured count), graph_used (a graph runner replayed),
      layer_ops (each decoder layer's dispatcher ops), layer_ops_max, forward_ops_per_layer
      (forward_ops / layers: issue 26's ops per layer; see ``decode_launches``),
      flags (as the worker saw them), itl_p50_vs_default (ratio; null without a default row),
      step_ops, step_syncs, forward_ops, forward_syncs: what one eager decode step (the second
      of a 3-token generate) dispatches, as bench_common.count_launches counts it, for the
      whole step and for the model forward inside it (null with graphs); step_device_syncs: of
      the step's host reads, those of data computed from the device's tensors (weights, KV
      pool, request table) on a CPU run, i.e. what a GPU run would wait for (the allocator's
      bookkeeping lives on the host there too); on a GPU, null (step_syncs then counts
      device-to-host copies)
  "errors": [{"config", "concurrency", "context_len", "error"}] for cases or workers that failed

Run: python scripts/bench_decode.py [--quick] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import bench_common as bc
import decode_launches
from bench_model import add_model_args, build_model
import weight_reads
from bench_set_kv import peak_hbm_bytes_per_s

FLAG_FLIPS = (("DSV4_GRAPH", "0"), ("DSV4_CACHE_SWA_TRANSLATION", "0"),
              ("DSV4_MULTI_STREAM_PREPARE", "1"))
FULL_FLIPS = (("DSV4_FUSED_SWA_TRANSLATE", "1"),)          # beyond --quick
EAGER_FLIPS = (("DSV4_CACHE_SWA_TRANSLATION", "0"), ("DSV4_MULTI_STREAM_PREPARE", "1"),
               ("DSV4_NUMERICS", "fp32"), ("DSV4_FUSED_SWA_TRANSLATE", "1"))
KERNEL_BACKENDS = ("torch", "triton", "hip")
RESULT, MODEL = "RESULT ", "MODEL "


def config_name(env: dict[str, str]) -> str:
    return "+".join(f"{k}={v}" for k, v in env.items()) or "default"


def flag_configs(quick: bool, gpu: bool) -> list[dict]:
    envs = [{}] + [{k: v} for k, v in FLAG_FLIPS]
    if not quick:
        envs += [{k: v} for k, v in FULL_FLIPS]
        envs += [{"DSV4_GRAPH": "0", k: v} for k, v in EAGER_FLIPS]
        if gpu:
            envs += [{"DSV4_KERNEL_BACKEND": b} for b in KERNEL_BACKENDS]
    return [{"name": config_name(e), "env": e} for e in envs]


# ---- worker: one flag configuration, in its own process -----------------------------------


class StepClock:
    """Timestamps of the decode steps of an engine: wraps engine.forward and, when the engine
    has a graph runner, its replay (outermost call only), for the duration of a `with`."""

    def __init__(self, engine):
        self.engine = engine
        self.starts: list[float] = []
        self.swa_stats: list[tuple[int, int]] = []  # (translations, hits) at each step's start
        self.replays = 0
        self._depth = 0
        self._patched: list[tuple[object, str]] = []

    def _wrap(self, owner, name: str, is_decode) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if self._depth == 0 and is_decode(*args, **kwargs):
                self.starts.append(time.perf_counter())
                stats = self.engine.pool.swa_loc_stats
                self.swa_stats.append((stats.translations, stats.hits))
                self.replays += name == "replay"
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        setattr(owner, name, timed)
        self._patched.append((owner, name))

    def __enter__(self) -> "StepClock":
        self._wrap(self.engine, "forward", lambda batch, *a, **k: batch.is_decode)
        runner = getattr(self.engine, "graph_runner", None)
        if runner is not None:
            self._wrap(runner, "replay", lambda *a, **k: True)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name in self._patched:
            delattr(owner, name)  # the instance attribute shadowed the class's method


def run_case(model, spec: dict, concurrency: int, context_len: int) -> dict:
    from dsv4.engine import Engine

    new_tokens = spec["new_tokens"]
    engine = Engine(model, max_batch=concurrency, max_context_len=context_len + new_tokens,
                    page_size=spec["page_size"])
    g = torch.Generator().manual_seed(spec["seed"] + concurrency * 7919 + context_len)
    prompts = torch.randint(2, model.config.vocab_size, (concurrency, context_len),
                            generator=g).tolist()
    engine.generate(prompts, 3)  # warm-up: lazy initialisation, graph capture
    with StepClock(engine) as clock:
        t0 = time.perf_counter()
        engine.generate(prompts, new_tokens)
        end = time.perf_counter()
    steps = len(clock.starts)
    if steps == 0:
        raise RuntimeError("no decode step was seen (new_tokens must be >= 2)")
    bounds = clock.starts + [end]
    itl = sorted((b - a) * 1e3 for a, b in zip(bounds, bounds[1:]))
    decode_s = end - clock.starts[0]
    graph_used = clock.replays > 0
    stats = engine.pool.swa_loc_stats
    translations, hits = (now - first for now, first in zip((stats.translations, stats.hits),
                                                             clock.swa_stats[0]))
    return {
        "concurrency": concurrency, "context_len": context_len, "new_tokens": new_tokens,
        "decode_steps": steps,
        "itl_ms_p50": round(bc.Timing(itl, "perf_counter").p50, 3),
        "itl_ms_p90": round(bc.Timing(itl, "perf_counter").p90, 3),
        "itl_ms_mean": round(sum(itl) / steps, 3),
        "prefill_ms": round((clock.starts[0] - t0) * 1e3, 3),
        "decode_tokens_per_s": round(concurrency * steps / decode_s, 3),
        "e2e_tokens_per_s": round(concurrency * new_tokens / (end - t0), 3),
        # Replayed graphs gather inside the graph, unseen by the pool's counters.
        "swa_translations_per_step": None if graph_used else round(translations / steps, 3),
        "swa_cache_hits_per_step": None if graph_used else round(hits / steps, 3),
        "graph_used": graph_used,
        **(dict.fromkeys(decode_launches.STEP_KEYS)
           if graph_used else decode_launches.count_decode_step(engine, prompts)),
    }


def worker(spec: dict) -> None:
    """Print one MODEL line, then one RESULT line per case (stdout, JSON)."""
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    model, info = build_model(spec)
    print(MODEL + json.dumps({**info, "flags": bc.flag_values()}), flush=True)
    with torch.no_grad():
        for context_len in spec["contexts"]:
            for concurrency in spec["concurrency"]:
                case = {"concurrency": concurrency, "context_len": context_len}
                try:
                    row = run_case(model, spec, concurrency, context_len)
                except Exception as e:  # noqa: BLE001 - reported in the JSON, the sweep goes on
                    row = {**case, "error": f"{type(e).__name__}: {e}"}
                    if bc.on_gpu():
                        torch.cuda.empty_cache()
                print(RESULT + json.dumps(row), flush=True)


# ---- parent: one worker per configuration ----------------------------------------------------


def run_config(config: dict, spec: dict, bar) -> tuple[dict | None, list[dict], list[dict]]:
    """(model info, rows, errors) of one configuration's worker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env.update(config["env"])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    info, rows, errors = None, [], []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        for line in proc.stdout:
            if line.startswith(MODEL):
                info = json.loads(line[len(MODEL):])
            elif line.startswith(RESULT):
                row = {"config": config["name"], "env": config["env"],
                       **json.loads(line[len(RESULT):])}
                if "error" in row:
                    errors.append({k: row[k] for k in ("config", "concurrency", "context_len",
                                                        "error")})
                else:
                    rows.append({**row, "flags": info["flags"]})
                bar.update()
        if proc.wait() != 0:
            err.seek(0)
            tail = err.read()[-2000:]
            errors.append({"config": config["name"], "concurrency": None, "context_len": None,
                           "error": f"worker exited with {proc.returncode}: {tail}"})
    return info, rows, errors


def add_ratios(rows: list[dict]) -> None:
    default = {(r["concurrency"], r["context_len"]): r["itl_ms_p50"] for r in rows
               if r["config"] == "default"}
    for r in rows:
        base = default.get((r["concurrency"], r["context_len"]))
        r["itl_p50_vs_default"] = round(r["itl_ms_p50"] / base, 4) if base else None


def add_floor_ratios(reads: list[dict], rows: list[dict]) -> None:
    """itl_vs_floor of each weight-reads row: the default configuration's ITL p50 at its batch
    and context over its floor."""
    itl = {(r["concurrency"], r["context_len"]): r["itl_ms_p50"] for r in rows
           if r["config"] == "default"}
    for r in reads:
        base = itl.get((r["concurrency"], r["context_len"]))
        r["itl_vs_floor"] = round(base / r["floor_ms"], 3) if base and r["floor_ms"] else None


def weight_read_rows(spec: dict) -> list[dict]:
    """``weight_reads.count_decode_step`` for each weight format the config allows."""
    from dsv4.config import ModelConfig
    from dsv4.weights.formats import native_problem

    rows = []
    narrow = native_problem(ModelConfig.preset(spec["preset"]))
    peak = peak_hbm_bytes_per_s()
    for weights in spec["weight_reads"] or (("bf16",) if narrow else ("native", "bf16")):
        model, _ = build_model({**spec, "weights": weights})
        with torch.no_grad():
            row = weight_reads.count_decode_step(model, spec["concurrency"][0],
                                                 spec["contexts"][0], spec["seed"])
        row.update(decode_launches.kv_bytes(model.config, row["concurrency"],
                                            row["context_len"] + 2))  # the second decode step
        row["floor_ms"] = decode_launches.floor_ms(
            row["native_active_bytes"] + row["kv_read_bytes"] + row["kv_written_bytes"], peak)
        rows.append(row)
        del model
    return rows


def summary_lines(rows: list[dict], errors: list[dict],
                  reads: list[dict] = ()) -> list[str]:
    """The figures printed after a run, one line per case (the JSON holds the rest)."""
    width = max([len("config")] + [len(r["config"]) for r in rows])
    lines = [f"{'config':{width}s} {'batch':>5s} {'context':>7s} {'ITL p50 ms':>10s} "
             f"{'decode tok/s':>12s} graph ops/layer (max layer)"]
    for r in rows:
        ops = (f"{r['forward_ops_per_layer']:.1f} ({r['layer_ops_max']})"
               if r.get("layer_ops_max") is not None else "-")
        lines.append(f"{r['config']:{width}s} {r['concurrency']:5d} {r['context_len']:7d} "
                     f"{r['itl_ms_p50']:10.2f} {r['decode_tokens_per_s']:12.1f} "
                     f"{'yes' if r['graph_used'] else 'no':5s} {ops}")
    for r in reads:
        lines.append(f"weights {r['weights']}: one decode step (batch {r['concurrency']}, "
                     f"context {r['context_len']}) reads {r['bytes_read'] / 1e6:.2f} MB of "
                     f"weights, {r['read_vs_native_active']:.2f}x the native active "
                     f"{r['native_active_bytes'] / 1e6:.2f} MB; KV rows "
                     f"{(r['kv_read_bytes'] + r['kv_written_bytes']) / 1e6:.2f} MB; " + (
                         f"floor at peak HBM bandwidth {r['floor_ms']} ms, ITL "
                         f"{r['itl_vs_floor']}x the floor" if r["floor_ms"]
                         else "no GPU here: no step time to set against the floor"))
    for e in errors:
        lines.append(f"error: {e['config']}, concurrency {e['concurrency']}, context "
                     f"{e['context_len']}: {e['error']}")
    return lines


def weight_formats(text: str) -> tuple[str, ...]:
    formats = tuple(text.split(","))
    unknown = [f for f in formats if f not in ("native", "bf16")]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown weight formats {unknown}; known: native, bf16")
    return formats


def parse_args(argv=None):
    gpu = bc.on_gpu()
    p = bc.parser(__doc__.split("\n")[0], "results/bench_decode.json", repetitions=False)
    add_model_args(p, "flash" if gpu else "tiny",
                   "model preset (default: flash on a GPU, tiny on a CPU)",
                   "keep only the first N layers (default: 4 for flash/pro, all for tiny)")
    p.add_argument("--weight-reads", type=weight_formats, default=None,
                   help="weight formats whose bytes per step are counted, comma-separated "
                        "(default: native,bf16 where the config allows native, else bf16; a "
                        "native count of a Flash slice runs the torch FP8/FP4 GEMMs: minutes "
                        "on a CPU)")
    p.add_argument("--concurrency", type=bc.int_list, default=None,
                   help="batch sizes (default 1,2,4,8,16,32,64; quick 1,4)")
    p.add_argument("--contexts", type=bc.int_list, default=None,
                   help="prompt lengths (default 1024,4096 on a GPU, 32,512 on a CPU; quick 32)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens generated per request (default 65; quick 9)")
    p.add_argument("--configs", default=None,
                   help="comma-separated configuration names to run (default: all; see --help "
                        "text above; e.g. default,DSV4_GRAPH=0)")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return args
    bc.resolve_repetitions(args)
    args.layers = args.layers or (4 if args.preset in ("flash", "pro") else None)
    args.concurrency = args.concurrency or ([1, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64])
    args.contexts = args.contexts or ([32] if args.quick else
                                      [1024, 4096] if gpu else [32, 512])
    args.new_tokens = args.new_tokens or (9 if args.quick else 65)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (the first token comes from the prefill)")
    if "native" in (args.weight_reads or ()):
        from dsv4.config import ModelConfig
        from dsv4.weights.formats import native_problem

        problem = native_problem(ModelConfig.preset(args.preset))
        if problem:
            p.error(f"--weight-reads native: {problem}")
    configs = flag_configs(args.quick, gpu)
    if args.configs:
        wanted = args.configs.split(",")
        known = {c["name"] for c in configs} | {c["name"] for c in flag_configs(False, True)}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            p.error(f"--configs: unknown {unknown}; known: {sorted(known)}")
        configs = [c for c in flag_configs(False, True) if c["name"] in wanted]
    args.flag_configs = configs
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return None
    spec = {k: getattr(args, k) for k in ("preset", "layers", "experts", "vocab", "weights",
                                          "weight_reads", "init", "concurrency", "contexts",
                                          "new_tokens", "page_size", "seed", "threads")}
    record = bc.new_record("bench_decode", args, {**spec, "configs": [
        c["name"] for c in args.flag_configs]})
    record["configs"] = args.flag_configs
    record["notes"] = [] if bc.on_gpu() else [
        "CPU: DSV4_KERNEL_BACKEND configurations skipped (only the torch path runs here); "
        "graphs, if used, are the CPU emulation: their times say nothing about a GPU"]
    model, rows, errors = None, [], []
    cases = len(args.concurrency) * len(args.contexts)
    with bc.progress(cases * len(args.flag_configs), "decode", args.no_progress) as bar:
        for config in args.flag_configs:
            bar.set_postfix_str(config["name"])
            info, config_rows, config_errors = run_config(config, spec, bar)
            model = model or info
            rows += config_rows
            errors += config_errors
    if model is not None:
        model = {k: v for k, v in model.items() if k != "flags"}
    add_ratios(rows)
    reads = weight_read_rows(spec)
    add_floor_ratios(reads, rows)
    record.update(model=model, results=rows, errors=errors, weight_reads=reads)
    bc.write_json(args.out, record)
    print("\n".join(summary_lines(rows, errors, reads)))
    print(f"wrote {args.out} ({len(rows)} rows, {len(errors)} errors)")
    return record


if __name__ == "__main__":
    main()
