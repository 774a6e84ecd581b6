"""SGLang's stock DeepSeek-V4 SWA KV path versus the dsv4-rocm plugin's, per decode step.

One decode step, as SGLang 0.5.23 runs it on a real DeepSeekV4TokenToKVPool: the SWA slots of
out_cache_loc are translated once per forward (`translate_loc_from_full_to_swa`, as its attention
metadata does), then every layer calls `set_swa_key_buffer_radix_fused_norm_rope` (RMSNorm +
RoPE + FP8 store of the layer's KV row, q rotated in the same call). Paths:
  sglang_stock   SGLang's own setter (its JIT GPU kernel: it cannot run on a CPU, and the row
                 then says why instead of giving numbers)
  dsv4_plugin    the same call after SGLang's loader installed the plugin (our set-KV op)
Modes: eager, and graph (the step captured once and replayed: torch.cuda.CUDAGraph on a GPU, the
CPU emulation of dsv4.graphs otherwise). Models: flash = 43 layers, pro = 61 layers.
Per step: host time (p50, p90; device events on a GPU) and launches (device kernels on a GPU,
aten ops on a CPU; in CPU graph mode the ops the emulated graph re-runs) and host syncs.

Needs SGLang installed (README: requirements/sglang*.txt). On a CPU without torchvision the
test stub of torchvision (tests/stubs, not the real package) is put on the import path.

Run: python scripts/bench_sglang_plugin.py [--quick] [--out FILE.json]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

import bench_common as bc
from bench_swa_translation import MODELS, emulated_graph_launches

PATHS = ("sglang_stock", "dsv4_plugin")
MODES = ("eager", "graph")
EPS = 1e-6


def load_sglang_with_plugin():
    """SGLang's loader run in this process; returns the pool class (its setters hooked)."""
    if importlib.util.find_spec("torchvision") is None:
        sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "stubs"))
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_context

    if not bc.on_gpu():
        get_context().override_server_args(device="cpu").install()
    load_plugins()
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool as Pool

    if not hasattr(Pool.set_swa_key_buffer_radix_fused_norm_rope, "__wrapped__"):
        raise SystemExit("the dsv4-rocm plugin is not active (DSV4_SGLANG_PLUGIN=0 or "
                         "SGLANG_PLUGINS without dsv4_rocm?)")
    return Pool


def build(pool_cls, n_layers: int, batch: int, page_size: int, heads: int):
    dev = bc.device()
    pool = pool_cls(
        max_num_reqs=batch, swa_size=2 * batch * page_size, c4_size=page_size, c128_size=8,
        c4_state_pool_size=64, c128_state_pool_size=512, page_size=page_size,
        swa_page_size=page_size, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
        indexer_head_dim=128, layer_num=n_layers, device=str(dev), enable_memory_saver=False,
        compression_ratios=[0] * n_layers)
    full = 4 * batch * page_size
    mapping = torch.zeros(full + 1, dtype=torch.int64, device=dev)
    mapping[:full] = torch.arange(full, device=dev) % (2 * batch * page_size) + page_size
    mapping[full] = -1
    pool.register_mapping(mapping)
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(4096, 32, generator=g) * 6.28
    return dict(
        pool=pool, loc=torch.randperm(full, generator=g)[:batch].to(dev),
        kv=torch.randn(batch, 512, generator=g).to(dev, torch.bfloat16),
        weight=(1 + 0.1 * torch.randn(512, generator=g)).to(dev, torch.bfloat16),
        freqs_cis=torch.polar(torch.ones_like(angles), angles).to(dev),
        positions=torch.randint(0, 4096, (batch,), generator=g).to(dev),
        q=torch.randn(batch, heads, 512, generator=g).to(dev, torch.bfloat16))


def step_fn(path: str, s: dict, n_layers: int):
    pool = s["pool"]
    setter = type(pool).set_swa_key_buffer_radix_fused_norm_rope
    if path == "sglang_stock":
        setter = setter.__wrapped__

    def step() -> None:
        swa_loc = pool.translate_loc_from_full_to_swa(s["loc"]).to(torch.int32)
        for layer_id in range(n_layers):
            setter(pool, layer_id=layer_id, swa_loc=swa_loc, kv=s["kv"], kv_weight=s["weight"],
                   eps=EPS, freqs_cis=s["freqs_cis"], positions=s["positions"], q=s["q"])

    return step


def measure(step, mode: str, args) -> dict:
    from dsv4.graphs import select_backend
    from dsv4.options import Options

    with torch.no_grad():
        step()
        run, graph = step, None
        if mode == "graph":
            backend = select_backend(choice=Options.from_env().graph_backend)
            graph = backend.new_graph()
            with backend.capture(graph, backend.pool_handle()):
                step()
            backend.synchronize()
            run = graph.replay
        timing = bc.time_op(run, args.warmup, args.reps).summary()
        if graph is not None and not bc.on_gpu():
            launches = emulated_graph_launches(graph)
        else:
            launches = bc.count_launches(run)
    return {"us_per_step_p50": timing["p50_us"], "us_per_step_p90": timing["p90_us"],
            "launches_per_step": launches.launches, "host_syncs_per_step": launches.host_syncs}


def run_case(path: str, mode: str, s: dict, n_layers: int, args) -> dict:
    step = step_fn(path, s, n_layers)
    try:
        return measure(step, mode, args)
    except Exception as e:  # SGLang's stock kernel on a machine it does not support
        if path != "sglang_stock":
            raise
        return {"unavailable": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def parse_args(argv=None):
    p = bc.parser(__doc__.split("\n")[0], "results/bench_sglang_plugin.json")
    p.add_argument("--models", default=",".join(MODELS), help="flash,pro or one of them")
    p.add_argument("--batches", type=bc.int_list, default=None,
                   help="batch sizes (default 1,8,64; quick 1,8)")
    p.add_argument("--modes", default=",".join(MODES), help="eager,graph or one of them")
    p.add_argument("--heads", type=int, default=8, help="q heads rotated per call (default 8)")
    p.add_argument("--page-size", type=int, default=256, help="page size in tokens (default 256)")
    args = p.parse_args(argv)
    bc.resolve_repetitions(args)
    args.models, args.modes = args.models.split(","), args.modes.split(",")
    args.batches = args.batches or ([1, 8] if args.quick else [1, 8, 64])
    for name, values, known in (("models", args.models, MODELS), ("modes", args.modes, MODES)):
        bc.check_choices(p, name, values, known)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    pool_cls = load_sglang_with_plugin()
    from dsv4.graphs import select_backend
    from dsv4.options import Options
    from dsv4.plugins import sglang as plugin

    config = {k: getattr(args, k) for k in ("models", "batches", "modes", "heads", "page_size",
                                            "warmup", "reps", "threads")}
    record = bc.new_record("bench_sglang_plugin", args, config)
    record["launch_counter"] = "device_kernels" if bc.on_gpu() else "cpu_aten_ops"
    record["graph_backend"] = select_backend(choice=Options.from_env().graph_backend).name
    record["plugin"] = plugin.status()
    rows = []
    cases = [(m, b) for m in args.models for b in args.batches]
    with bc.progress(len(cases) * len(args.modes) * len(PATHS), "sglang plugin",
                     args.no_progress) as bar:
        for model, batch in cases:
            s = build(pool_cls, MODELS[model], batch, args.page_size, args.heads)
            for mode in args.modes:
                for path in PATHS:
                    bar.set_postfix_str(f"{model} bs={batch} {mode} {path}")
                    rows.append({"model": model, "n_layers": MODELS[model], "batch": batch,
                                 "mode": mode, "path": path,
                                 **run_case(path, mode, s, MODELS[model], args)})
                    bar.update()
    record["results"] = rows
    bc.write_json(args.out, record)
    print(f"wrote {args.out}")
    for r in rows:
        numbers = r.get("unavailable") or (
            f"{r['us_per_step_p50']} us/step p50, {r['launches_per_step']} launches, "
            f"{r['host_syncs_per_step']} host syncs")
        print(f"{r['model']:5} bs={r['batch']:<3} {r['mode']:5} {r['path']:12} {numbers}")
    return record


if __name__ == "__main__":
    main()
