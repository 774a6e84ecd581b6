"""The decode path's cache readers per backend: sparse attention and indexer scores over the FP8
paged caches, time and effective bandwidth.

Cases: sparse_decode_attention (one query row per request: its window of --window SWA rows and
--comp compressed rows, --heads heads; both numerics) and indexer_scores (--index-heads heads
against --index-rows compressed keys; bf16 weights, the reference numerics) x batch in
--batches x every backend that runs here, on the device present. Backends: torch (the reference:
dequantize the gathered rows, then the math), always; triton on a GPU, on a CPU only when asked
(--backends torch,triton with TRITON_INTERPRET=1: interpreter times say nothing about a GPU).
The defaults are DeepSeek-V4-Flash's shapes (64 heads, window 128, 512 selected compressed rows;
64 index heads, 1,024 compressed rows = 4,096 tokens of context). Every row a query reads is a
distinct random slot of a cache written by the store ops. Each op is timed through its
dispatcher op; outside a graph, its argument checks run on the host (no host sync: value checks
are off here).

bytes = what an ideal kernel moves per call: each row read once (584 B per KV row, 132 B per
indexer key) plus q, o, weights, locations and valid flags. gb_per_s = bytes / p50 (1e9 B/s);
hbm_fraction = bytes / p50 / peak HBM bandwidth (by device name: MI300X, MI355X, H100, H200);
null on a CPU. max_abs_diff: the largest difference from the torch backend's output on the
same inputs (null for torch itself).

Output JSON (beyond bench_common's record keys):
  "peak_hbm_bytes_per_s", "skipped": {backend: why}, "notes"
  "results": one row per (op, numerics, backend, batch): op, numerics, backend, batch, p50_us,
      p90_us, min_us, reps, clock, bytes, gb_per_s, hbm_fraction, max_abs_diff

Run: python scripts/bench_decode_kernels.py [--quick] [--out FILE.json] [--batches 1,16,64]
         [--backends torch,triton] [--heads 64] [--window 128] [--comp 512]
         [--index-heads 64] [--index-rows 1024]
"""

from __future__ import annotations

import torch

import bench_common as bc
from bench_set_kv import peak_hbm_bytes_per_s, skip_reason
from hip_kernels import KernelOptions, kv_layout as L, set_kv
from hip_kernels.decode_attention import sparse_decode_attention
from hip_kernels.indexer_scores import indexer_scores
from hip_kernels.platform import fp8_dialect

BACKENDS = ("torch", "triton")
PAGE = 64
INTERPRETER_NOTE = "triton ran in its CPU interpreter: its times say nothing about a GPU"


def _slots(g, batch: int, width: int, capacity: int) -> torch.Tensor:
    """[batch, width] distinct slots per row (slot 0, the dummy, excluded)."""
    return torch.stack([torch.randperm(capacity - 1, generator=g)[:width] + 1
                        for _ in range(batch)])


def attention_inputs(batch: int, args, g) -> dict:
    dev = bc.device()
    slots = max(args.window, args.comp) * 2 + PAGE
    slots = -(-slots // PAGE) * PAGE
    caches = []
    for _ in range(2):
        cache = torch.zeros(slots // PAGE, L.page_bytes(PAGE), dtype=torch.uint8)
        set_kv.fused_store_cache(torch.randn(slots, L.HEAD_DIM, generator=g).bfloat16(), cache,
                                 torch.arange(slots), PAGE, kernel=kernel_options("torch"))
        caches.append(cache.to(dev))
    return dict(q=torch.randn(batch, args.heads, L.HEAD_DIM, generator=g).bfloat16().to(dev),
                swa_cache=caches[0], window_loc=_slots(g, batch, args.window, slots).to(dev),
                window_valid=torch.ones(batch, args.window, dtype=torch.bool, device=dev),
                swa_page_size=PAGE, comp_cache=caches[1],
                comp_loc=_slots(g, batch, args.comp, slots).to(dev),
                comp_valid=torch.ones(batch, args.comp, dtype=torch.bool, device=dev),
                comp_page_size=PAGE, sink=torch.randn(args.heads, generator=g).to(dev),
                scale=L.HEAD_DIM ** -0.5)


def indexer_inputs(batch: int, args, g) -> dict:
    dev = bc.device()
    slots = -(-(args.index_rows + 1) // PAGE) * PAGE
    cache = torch.zeros(slots // PAGE, L.indexer_page_bytes(PAGE), dtype=torch.uint8)
    set_kv.indexer_store(torch.randn(slots, L.INDEX_DIM, generator=g).bfloat16(), cache,
                         torch.arange(slots), PAGE, pow2_scale=True, kernel=kernel_options("torch"))
    return dict(q=torch.randn(batch, args.index_heads, L.INDEX_DIM, generator=g).bfloat16()
                .to(dev),
                weights=(torch.randn(batch, args.index_heads, generator=g) * 0.01).bfloat16()
                .to(dev), cache=cache.to(dev),
                loc=_slots(g, batch, args.index_rows, slots).to(dev),
                valid=torch.ones(batch, args.index_rows, dtype=torch.bool, device=dev),
                page_size=PAGE)


def moved_bytes(op: str, a: dict) -> int:
    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts)

    if op == "indexer_scores":
        out = a["loc"].numel() * a["weights"].element_size()
        return (a["loc"].numel() * L.INDEX_TOKEN_BYTES + nbytes(a["q"], a["weights"], a["loc"],
                                                                a["valid"]) + out)
    rows = a["window_loc"].numel() + a["comp_loc"].numel()
    return (rows * L.TOKEN_BYTES + 2 * nbytes(a["q"])
            + nbytes(a["window_loc"], a["window_valid"], a["comp_loc"], a["comp_valid"]))


def kernel_options(backend: str) -> KernelOptions:
    """The KernelOptions of every timed call: no host range check (a sync per call), the
    platform's fp8 dialect."""
    return KernelOptions(backend=backend, value_checks=False, fp8_dialect=fp8_dialect())


def run(op: str, numerics: str, backend: str, a: dict):
    if op == "indexer_scores":
        return indexer_scores(**a, kernel=kernel_options(backend))
    return sparse_decode_attention(**a, reference=numerics == "reference",
                                   kernel=kernel_options(backend))


def measure(op: str, numerics: str, backend: str, batch: int, args) -> dict:
    g = torch.Generator().manual_seed(batch)
    a = (indexer_inputs if op == "indexer_scores" else attention_inputs)(batch, args, g)
    diff = None
    if backend != "torch":
        want = run(op, numerics, "torch", a).float()
        got = run(op, numerics, backend, a).float()
        diff = float((got - want).abs().max())
    t = bc.time_op(lambda: run(op, numerics, backend, a), args.warmup, args.reps).summary()
    moved = moved_bytes(op, a)
    peak = peak_hbm_bytes_per_s()
    return {"op": op, "numerics": numerics, "backend": backend, "batch": batch,
            **{k: t[k] for k in ("p50_us", "p90_us", "min_us", "reps", "clock")},
            "bytes": moved, "gb_per_s": round(moved / t["p50_us"] / 1e3, 4),
            "hbm_fraction": round(moved / (t["p50_us"] * 1e-6) / peak, 5) if peak else None,
            "max_abs_diff": diff}


def parse_args(argv=None):
    p = bc.parser(__doc__.split("\n")[0], "results/bench_decode_kernels.json")
    p.add_argument("--batches", type=bc.int_list, default=None,
                   help="query rows per call (default 1,16,64 on a GPU; 1,4 on a CPU)")
    p.add_argument("--backends", default=None,
                   help="comma-separated of torch,triton (default: all that run here; triton on "
                        "a CPU only when named)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 64)")
    p.add_argument("--window", type=int, default=128, help="window rows per query (default 128)")
    p.add_argument("--comp", type=int, default=None,
                   help="compressed rows per query (default 512; 64 on a CPU)")
    p.add_argument("--index-heads", type=int, default=64, help="indexer heads (default 64)")
    p.add_argument("--index-rows", type=int, default=None,
                   help="compressed keys scored per query (default 1024; 128 on a CPU)")
    args = p.parse_args(argv)
    bc.resolve_repetitions(args)
    gpu = bc.on_gpu()
    args.batches = args.batches or ([1, 16, 64] if gpu else [1, 4])
    args.heads = args.heads or (64 if gpu else 16)
    args.comp = args.comp or (512 if gpu else 64)
    args.index_rows = args.index_rows or (1024 if gpu else 128)
    args.asked = args.backends is not None
    args.backends = (args.backends or ",".join(BACKENDS)).split(",")
    bc.check_choices(p, "backends", args.backends, BACKENDS)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = {k: getattr(args, k) for k in ("batches", "backends", "heads", "window", "comp",
                                            "index_heads", "index_rows", "warmup", "reps")}
    record = bc.new_record("bench_decode_kernels", args, config)
    record["peak_hbm_bytes_per_s"] = peak_hbm_bytes_per_s()
    skipped = {b: r for b in args.backends if (r := skip_reason(b, args.asked))}
    record["skipped"] = skipped
    record["notes"] = ([INTERPRETER_NOTE] if "triton" in args.backends
                       and "triton" not in skipped and not bc.on_gpu() else [])
    cases = [(op, numerics, b, n)
             for op, modes in (("sparse_decode_attention", ("reference", "fp32")),
                               ("indexer_scores", ("reference",)))
             for numerics in modes for b in args.backends if b not in skipped
             for n in args.batches]
    rows = []
    with torch.no_grad(), bc.progress(len(cases), "readers", args.no_progress) as bar:
        for case in cases:
            bar.set_postfix_str(" ".join(map(str, case)))
            rows.append(measure(*case, args))
            bar.update()
    record["results"] = rows
    bc.write_kernel_record(args.out, record, skipped)
    print(f"{'op':24s} {'numerics':9s} {'backend':7s} {'batch':>5s} {'p50 us':>10s} "
          f"{'GB/s':>9s} {'HBM':>6s} {'max diff':>9s}")
    for r in rows:
        hbm = f"{r['hbm_fraction']:.1%}" if r["hbm_fraction"] is not None else "-"
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.2e}"
        print(f"{r['op']:24s} {r['numerics']:9s} {r['backend']:7s} {r['batch']:5d} "
              f"{r['p50_us']:10.1f} {r['gb_per_s']:9.3f} {hbm:>6s} {diff:>9s}")
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
