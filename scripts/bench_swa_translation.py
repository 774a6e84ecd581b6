"""Cost per decode step of obtaining the SWA slots of out_cache_loc for every layer, four ways.

Methods (one decode step = every layer of the model asks for the SWA slots of the same
out_cache_loc; each step first bumps the pool's mapping generation, as the allocator's
alloc_decode does, so no translation survives from one step to the next):
  per_layer          (a) pool.translate_loc_from_full_to_swa in every layer
  start_layer        (b) recompute when layer_id == start layer, reuse otherwise: the rule peers
                         ship, implemented here only as a baseline (it goes stale when a forward
                         does not start at that layer, see docs/kv_memory.md)
  identity_cache     (c) pool.get_cached_swa_loc(loc, layer_id): one gather per step
  fused_translate    (d) hip_kernels.fused_translate_norm_rope_store in every layer: the set-KV
                         kernel translates itself (the KV store is part of the step)
  fused_precomputed  (d') hip_kernels.fused_k_norm_rope_store in every layer with the slots
                         computed before the step: (d) minus (d') = the marginal cost of
                         translating inside the kernel
Modes: "eager" (the ops as called, including the API's host-synchronizing range checks) and
"graph" (the step captured once and replayed: torch.cuda.CUDAGraph on a GPU, the CPU emulation
of dsv4.graphs otherwise; value checks are skipped inside capture, as in the engine's graphs).
Models: flash = 43 layers, pro = 61 layers (SWA-only pool; the compressed caches play no part).
Launches: eager, and graph replay on a GPU: bench_common.count_launches; graph mode on a CPU: the
ops the emulated graph re-runs at replay (capture admits no host sync, so host_syncs is 0).

Output JSON (beyond bench_common's record keys):
  "launch_counter": "device_kernels" | "cpu_aten_ops" (what "launches_per_step" counts)
  "graph_backend":  "cuda" | "emulate"
  "results": one row per (model, n_layers, batch, mode, method):
      us_per_step_p50, us_per_step_p90, us_per_layer (p50 / n_layers), launches_per_step,
      host_syncs_per_step, translations_per_step (pool gathers; in graph mode those captured),
      launches_by_name
  "derived": one row per (model, n_layers, batch, mode):
      translate_us_per_layer (per_layer p50 / n_layers: compare with anchor_us_per_layer),
      cache_saving_us_per_step (per_layer - identity_cache), start_layer_minus_cache_us_per_step,
      launches_saved_per_step (per_layer - identity_cache), fused_marginal_us_per_step,
      fused_marginal_us_per_layer, fused_marginal_launches_per_step
  "anchor_us_per_layer": 8.0 (SGLang PR 26931, MI3xx: see scripts/anchors.json)

Run: python scripts/bench_swa_translation.py [--quick] [--out FILE.json]
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

import bench_common as bc
from hip_kernels import fused_k_norm_rope_store, fused_translate_norm_rope_store
from mem_pool import KVCacheSpec, create_dsv4_kv_cache

MODELS = {"flash": 43, "pro": 61}
METHODS = ("per_layer", "start_layer", "identity_cache", "fused_translate", "fused_precomputed")
MODES = ("eager", "graph")
EPS = 1e-6
ANCHORS = Path(__file__).with_name("anchors.json")


class StartLayerRule:
    """The "recompute at layer == start_layer" cache: the baseline peers ship (benchmark only)."""

    def __init__(self, pool):
        self.pool = pool
        self.swa_loc = None

    def get(self, loc: torch.Tensor, layer_id: int) -> torch.Tensor:
        if layer_id == self.pool.start_layer or self.swa_loc is None:
            self.swa_loc = self.pool.translate_loc_from_full_to_swa(loc)
        return self.swa_loc


@dataclass
class Setup:
    """A pool with `batch` requests of `context_len` tokens and the next decode step's inputs."""
    pool: object
    loc: torch.Tensor        # out_cache_loc of the step [batch] int64
    swa_loc: torch.Tensor    # its SWA slots, precomputed (for fused_precomputed)
    kv: torch.Tensor         # [batch, 512] bf16
    weight: torch.Tensor     # [512] bf16
    freqs_cis: torch.Tensor  # [context_len + 1, 32] complex64
    positions: torch.Tensor  # [batch] int64
    page_size: int


def build(n_layers: int, batch: int, context_len: int, page_size: int) -> Setup:
    dev = bc.device()
    pages_per_req = -(-(context_len + 1) // page_size)
    tokens = batch * pages_per_req * page_size
    # the cache on whatever DSV4_CACHE_SWA_TRANSLATION says: identity_cache measures it
    pool, allocator = create_dsv4_kv_cache(KVCacheSpec(compress_ratios=(0,) * n_layers),
                                           tokens, tokens, page_size, dev,
                                           cache_swa_translation=True, swa_cache_verify=False)
    lens = torch.full((batch,), context_len, dtype=torch.int64)
    prompt = allocator.alloc_extend(torch.zeros_like(lens), lens, torch.full_like(lens, -1),
                                    batch * context_len)
    last = prompt.view(batch, context_len)[:, -1].cpu()
    loc = allocator.alloc_decode(lens + 1, last)
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(context_len + 1, 32, generator=g) * 6.28
    return Setup(pool, loc, pool.translate_loc_from_full_to_swa(loc),
                 torch.randn(batch, 512, generator=g).to(dev, torch.bfloat16),
                 (1 + 0.1 * torch.randn(512, generator=g)).to(dev, torch.bfloat16),
                 torch.polar(torch.ones_like(angles), angles).to(dev),
                 torch.full((batch,), context_len, dtype=torch.int64, device=dev), page_size)


def step_fn(method: str, s: Setup):
    """One decode step of `method` over every layer of the pool."""
    pool = s.pool
    layers = list(pool.spec.layer_ids)
    mapping = pool.full_to_swa_index_mapping
    rule = StartLayerRule(pool)

    def layer_op(layer_id: int) -> None:
        if method == "per_layer":
            pool.translate_loc_from_full_to_swa(s.loc)
        elif method == "start_layer":
            rule.get(s.loc, layer_id)
        elif method == "identity_cache":
            pool.get_cached_swa_loc(s.loc, layer_id)
        elif method == "fused_translate":
            fused_translate_norm_rope_store(s.kv, s.weight, EPS, s.freqs_cis, s.positions, s.loc,
                                            mapping, pool.get_swa_cache(layer_id), s.page_size)
        else:
            fused_k_norm_rope_store(s.kv, s.weight, EPS, s.freqs_cis, s.positions, s.swa_loc,
                                    pool.get_swa_cache(layer_id), s.page_size)

    def step() -> None:
        pool.bump_mapping_generation()  # what each step's alloc_decode does
        for layer_id in layers:
            layer_op(layer_id)

    return step


def graphed(step, pool):
    """(graph, translations captured): the step captured once, as the engine's graph runner
    does (warm-up, then invalidate the SWA location cache before the capture run)."""
    from dsv4.graphs import select_backend
    from dsv4.options import Options

    backend = select_backend(choice=Options.from_env().graph_backend)
    step()
    graph = backend.new_graph()
    pool.invalidate_loc_cache()
    before = pool.swa_loc_stats.translations
    with backend.capture(graph, backend.pool_handle()):
        step()
    backend.synchronize()
    return graph, pool.swa_loc_stats.translations - before


def emulated_graph_launches(graph) -> bc.LaunchCount:
    """The ops a CPU-emulated graph re-runs at replay: its kernels (profiling the replay would
    also count the copies into static outputs that only the emulation makes)."""
    by_name = Counter(f"aten::{op.func.overloadpacket.__name__}" for op in graph.ops if op.rerun)
    return bc.LaunchCount("cpu_aten_ops", sum(by_name.values()), 0, dict(by_name))


def measure(method: str, mode: str, s: Setup, args) -> dict:
    step = step_fn(method, s)
    with torch.no_grad():
        if mode == "graph":
            graph, translations = graphed(step, s.pool)
            run = graph.replay
        else:
            run = step
            step()
            before = s.pool.swa_loc_stats.translations
            step()
            translations = s.pool.swa_loc_stats.translations - before
        timing = bc.time_op(run, args.warmup, args.reps)
        if mode == "graph" and not bc.on_gpu():
            launches = emulated_graph_launches(graph)
        else:
            launches = bc.count_launches(run)
    n_layers = len(s.pool.spec.layer_ids)
    t = timing.summary()
    return {"us_per_step_p50": t["p50_us"], "us_per_step_p90": t["p90_us"],
            "us_per_layer": round(t["p50_us"] / n_layers, 3),
            "launches_per_step": launches.launches, "host_syncs_per_step": launches.host_syncs,
            "translations_per_step": translations, "launches_by_name": launches.by_name}


def hit_costs(s: Setup, calls: int, rounds: int = 7) -> dict:
    """Cost of one cache hit (a layer after the first in a step), three ways, interleaved in
    the same process: the start_layer rule, the identity cache's keyed lookup (the path every
    hit took before the same-tensor fast path) and the identity cache as called (fast path)."""
    pool, loc = s.pool, s.loc
    rule = StartLayerRule(pool)
    rule.get(loc, pool.start_layer)
    cache, mapping, translate = pool._loc_cache, pool.registered_mapping(), pool._translate
    other = pool.start_layer + 1
    ways = {"start_layer_hit_us": lambda: rule.get(loc, other),
            "identity_keyed_hit_us": lambda: cache.get(loc, mapping, translate),
            "identity_cache_hit_us": lambda: pool.get_cached_swa_loc(loc, other)}
    pool.get_cached_swa_loc(loc, other)
    samples: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    out = {k: round(statistics.median(v), 4) for k, v in samples.items()}
    out["cache_over_start_layer"] = round(out["identity_cache_hit_us"]
                                          / out["start_layer_hit_us"], 2)
    out["keyed_over_start_layer"] = round(out["identity_keyed_hit_us"]
                                          / out["start_layer_hit_us"], 2)
    out["calls_per_sample"] = calls
    return out


def derive(rows: list[dict]) -> list[dict]:
    """Per (model, batch, mode): what the cache saves and what translating in the kernel costs."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["n_layers"], r["batch"], r["mode"]), {})[r["method"]] = r
    out = []
    for (model, n_layers, batch, mode), m in groups.items():
        d = {"model": model, "n_layers": n_layers, "batch": batch, "mode": mode}
        if {"per_layer", "identity_cache"} <= m.keys():
            a, c = m["per_layer"], m["identity_cache"]
            d["translate_us_per_layer"] = round(a["us_per_step_p50"] / n_layers, 3)
            d["cache_saving_us_per_step"] = round(a["us_per_step_p50"] - c["us_per_step_p50"], 3)
            d["launches_saved_per_step"] = a["launches_per_step"] - c["launches_per_step"]
        if {"start_layer", "identity_cache"} <= m.keys():
            d["start_layer_minus_cache_us_per_step"] = round(
                m["start_layer"]["us_per_step_p50"] - m["identity_cache"]["us_per_step_p50"], 3)
        if {"fused_translate", "fused_precomputed"} <= m.keys():
            ft, fp = m["fused_translate"], m["fused_precomputed"]
            marginal = ft["us_per_step_p50"] - fp["us_per_step_p50"]
            d["fused_marginal_us_per_step"] = round(marginal, 3)
            d["fused_marginal_us_per_layer"] = round(marginal / n_layers, 3)
            d["fused_marginal_launches_per_step"] = (ft["launches_per_step"]
                                                     - fp["launches_per_step"])
        out.append(d)
    return out


def anchor_us_per_layer() -> float | None:
    if not ANCHORS.exists():
        return None
    for a in json.loads(ANCHORS.read_text())["anchors"]:
        if a["id"] == "sglang_pr26931_swa_loc_cache":
            return a["values"]["translate_us_per_layer"]
    return None


def parse_args(argv=None):
    p = bc.parser(__doc__.split("\n")[0], "results/bench_swa_translation.json")
    p.add_argument("--models", default=None,
                   help=f"comma-separated of {','.join(MODELS)} (default: both)")
    p.add_argument("--batches", type=bc.int_list, default=None,
                   help="batch sizes (default 1,2,4,8,16,32,64; quick 1,8)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    p.add_argument("--modes", default=",".join(MODES), help="eager,graph or one of them")
    p.add_argument("--context-len", type=int, default=300, help="tokens per request before the "
                   "decode step (default 300)")
    p.add_argument("--page-size", type=int, default=256, help="page size in tokens (default 256)")
    args = p.parse_args(argv)
    bc.resolve_repetitions(args)
    args.models = (args.models or ",".join(MODELS)).split(",")
    args.batches = args.batches or ([1, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64])
    args.methods, args.modes = args.methods.split(","), args.modes.split(",")
    for name, values, known in (("models", args.models, MODELS), ("methods", args.methods, METHODS),
                                ("modes", args.modes, MODES)):
        bc.check_choices(p, name, values, known)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from dsv4.graphs import select_backend
    from dsv4.options import Options

    config = {k: getattr(args, k) for k in ("models", "batches", "methods", "modes",
                                            "context_len", "page_size", "warmup", "reps", "threads")}
    config["n_layers"] = {m: MODELS[m] for m in args.models}
    record = bc.new_record("bench_swa_translation", args, config)
    record["launch_counter"] = "device_kernels" if bc.on_gpu() else "cpu_aten_ops"
    record["graph_backend"] = select_backend(choice=Options.from_env().graph_backend).name
    rows = []
    cases = [(m, b) for m in args.models for b in args.batches]
    with bc.progress(len(cases) * len(args.modes) * len(args.methods), "swa translation",
                     args.no_progress) as bar:
        for model, batch in cases:
            setup = build(MODELS[model], batch, args.context_len, args.page_size)
            for mode in args.modes:
                for method in args.methods:
                    bar.set_postfix_str(f"{model} bs={batch} {mode} {method}")
                    rows.append({"model": model, "n_layers": MODELS[model], "batch": batch,
                                 "mode": mode, "method": method,
                                 **measure(method, mode, setup, args)})
                    bar.update()
            del setup
    record["results"] = rows
    record["derived"] = derive(rows)
    setup = build(MODELS[args.models[0]], 1, args.context_len, args.page_size)
    record["hit_cost"] = hit_costs(setup, 2000 if args.quick else 20000)
    h = record["hit_cost"]
    print(f"cache hit: start_layer rule {h['start_layer_hit_us']} us, identity cache "
          f"{h['identity_cache_hit_us']} us ({h['cache_over_start_layer']}x; keyed lookup "
          f"{h['identity_keyed_hit_us']} us, {h['keyed_over_start_layer']}x)")
    record["anchor_us_per_layer"] = anchor_us_per_layer()
    bc.write_json(args.out, record)
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
