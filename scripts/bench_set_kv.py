"""Fused set-KV ops per backend: time, effective bandwidth and fraction of peak HBM bandwidth.

Cases: every op (fused_k_norm_rope_store, fused_store_cache, fused_translate_norm_rope_store,
store_kv_pack, indexer_store) x every backend that can run here x N rows in --ns (default
1,8,64,256), on the device present (a ROCm/CUDA GPU, else the CPU). Backends:
  torch   the reference, always;
  triton  on a GPU; on a CPU only when asked (--backends ...,triton) with TRITON_INTERPRET=1 set,
          since only the interpreter runs there and its timings say nothing about a GPU;
  hip     the HIP C++ extension (ops 2, 3, 6), when it builds here (ROCm or CUDA with a compiler).
Each backend's dispatcher op is timed directly (hip_kernels.library.op(name, backend), the
op's overload of that backend): no argument checks, so no host-synchronizing location range
check. Before timing, the output bytes
of every backend but torch are compared with the torch reference's on the same inputs.
Locations are distinct random slots of a pool of `pages` pages (all rows written).

bytes = what an ideal kernel moves per call: the inputs it reads (rows, weight, the rows'
cos/sin, positions, locations, translated slots) plus what it writes (584 B per KV row, 132 per
indexer row, q read and written in place, swa_loc_out). gb_per_s = bytes / p50 (1e9 B/s).
hbm_fraction = bytes / p50 / peak HBM bandwidth of the GPU (MI300X 5.3 TB/s, MI355X 8 TB/s,
H100 3.35 TB/s, H200 4.8 TB/s, by device name); null on a CPU or an unknown GPU.

Output JSON (beyond bench_common's record keys):
  "peak_hbm_bytes_per_s": number or null
  "skipped": {backend: why it did not run}
  "notes": caveats of this run (e.g. Triton's interpreter on a CPU)
  "results": one row per (op, backend, n): op, backend, n, p50_us, p90_us, min_us, reps, clock,
      bytes, gb_per_s, hbm_fraction, matches_torch (null for torch itself)

Run: python scripts/bench_set_kv.py [--quick] [--out FILE.json] [--ns 1,8,64,256]
         [--backends torch,triton,hip] [--page-size 256] [--heads 0]
"""

from __future__ import annotations

from dataclasses import asdict

import torch

import bench_common as bc
from hip_kernels import kv_layout as L
from hip_kernels.backend import HIP_OPS, triton_usable
from hip_kernels.library import op as dispatcher_op
from hip_kernels.numerics import DEFAULT_NUMERICS
from hip_kernels.platform import fp8_dialect, triton_interpreted

OPS = ("fused_k_norm_rope_store", "fused_store_cache", "fused_translate_norm_rope_store",
       "store_kv_pack", "indexer_store")
BACKENDS = ("torch", "triton", "hip")
PEAK_HBM = {"MI300X": 5.3e12, "MI355X": 8.0e12, "H100": 3.35e12, "H200": 4.8e12}
EPS = 1e-6
INTERPRETER_NOTE = ("triton ran in its CPU interpreter: its times say nothing about a GPU, and "
                    "its fp32->fp8 cast differs from torch's for a few percent of values, so "
                    "matches_torch is expected to be false for the quantizing ops")
MAX_POS = 4096


def peak_hbm_bytes_per_s() -> float | None:
    if not bc.on_gpu():
        return None
    name = torch.cuda.get_device_name(0).upper()
    return next((peak for key, peak in PEAK_HBM.items() if key in name), None)


def skip_reason(backend: str, asked: bool) -> str:
    """'' when the backend runs here, else why not."""
    dev = bc.device()
    if backend == "triton":
        if dev.type == "cpu" and not asked:
            return ("not run on a CPU unless asked: only Triton's interpreter runs there (pass "
                    "--backends torch,triton with TRITON_INTERPRET=1)")
        if not triton_usable(dev):
            return "needs triton and a GPU, or TRITON_INTERPRET=1 set before triton is imported"
    if backend == "hip":
        from hip_kernels import set_kv_hip

        return set_kv_hip.unavailable_reason()
    return ""


def make_inputs(op: str, n: int, page_size: int, pages: int, heads: int, g, dialect) -> dict:
    """Keyword arguments of the op (set_kv.SCHEMAS; the dialect and numerics excluded)."""
    dev = bc.device()
    slots = pages * page_size
    loc = (torch.randperm(slots - 1, generator=g)[:n] + 1).to(dev)  # slot 0 is the dummy
    if op == "indexer_store":
        return dict(k=torch.randn(n, L.INDEX_DIM, generator=g).to(dev, torch.bfloat16),
                    cache=torch.zeros(pages, L.indexer_page_bytes(page_size), dtype=torch.uint8,
                                      device=dev), out_loc=loc, page_size=page_size)
    cache = torch.zeros(pages, L.page_bytes(page_size), dtype=torch.uint8, device=dev)
    rows = torch.randn(n, L.HEAD_DIM + 64, generator=g).to(dev, torch.bfloat16)[:, :L.HEAD_DIM]
    if op == "fused_store_cache":
        return dict(rows=rows, cache=cache, out_loc=loc, page_size=page_size)
    if op == "store_kv_pack":
        nope, rope, scales = L.quantize_kv_rows(rows.cpu(), dialect)
        return dict(nope_fp8=nope.to(dev), rope_bf16=rope.to(dev), scales=scales.to(dev),
                    cache=cache, out_loc=loc, page_size=page_size)
    angles = torch.rand(MAX_POS, L.ROPE_DIM // 2, generator=g) * 6.28
    weight = 1 + 0.1 * torch.randn(L.HEAD_DIM, generator=g)
    args = dict(kv=rows, weight=weight.to(dev, torch.bfloat16), eps=EPS,
                freqs_cis=torch.polar(torch.ones_like(angles), angles).to(dev),
                positions=torch.randint(0, MAX_POS, (n,), generator=g).to(dev))
    if op == "fused_k_norm_rope_store":
        q = torch.randn(n, heads, L.HEAD_DIM, generator=g).to(dev, torch.bfloat16)
        return dict(**args, out_loc=loc, cache=cache, page_size=page_size, q=q if heads else None)
    full_to_swa = torch.zeros(4 * slots, dtype=torch.int32, device=dev)
    full_loc = torch.randperm(4 * slots, generator=g)[:n].to(dev)
    full_to_swa[full_loc] = loc.to(torch.int32)
    return dict(**args, full_loc=full_loc, full_to_swa=full_to_swa, cache=cache,
                page_size=page_size, swa_loc_out=torch.empty(n, dtype=torch.int32, device=dev),
                q=None)


def moved_bytes(op: str, a: dict) -> int:
    """Bytes read + written per call by an ideal kernel (see the module docstring)."""
    def nbytes(t):
        return t.numel() * t.element_size() if t is not None else 0

    if op == "indexer_store":
        return nbytes(a["k"]) + nbytes(a["out_loc"]) + len(a["k"]) * L.INDEX_TOKEN_BYTES
    if op == "store_kv_pack":
        n = len(a["out_loc"])
        return (nbytes(a["nope_fp8"]) + nbytes(a["rope_bf16"]) + nbytes(a["scales"])
                + nbytes(a["out_loc"]) + n * L.TOKEN_BYTES)
    if op == "fused_store_cache":
        return nbytes(a["rows"]) + nbytes(a["out_loc"]) + len(a["rows"]) * L.TOKEN_BYTES
    n = len(a["kv"])
    total = (nbytes(a["kv"]) + nbytes(a["weight"]) + n * (L.ROPE_DIM // 2) * 8
             + nbytes(a["positions"]) + n * L.TOKEN_BYTES)
    if op == "fused_k_norm_rope_store":
        return total + nbytes(a["out_loc"]) + 2 * nbytes(a["q"])
    return (total + nbytes(a["full_loc"]) + n * a["full_to_swa"].element_size()
            + nbytes(a["swa_loc_out"]))


NUMERICS = asdict(DEFAULT_NUMERICS)     # the ops' numerics arguments, made once


def call(backend: str, op: str, a: dict, dialect) -> None:
    fn = dispatcher_op(op, backend)
    if op == "store_kv_pack":
        fn(**a)
    elif op == "indexer_store":
        fn(**a, dialect=dialect.name, pow2_scale=False, key_tile=0)   # row-major keys
    else:
        fn(**a, dialect=dialect.name, **NUMERICS)


def outputs_match_torch(backend: str, op: str, a: dict, dialect) -> bool:
    def fresh():
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}

    want, got = fresh(), fresh()
    call("torch", op, want, dialect)
    call(backend, op, got, dialect)
    bc.synchronize()
    return all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
               for k in ("cache", "q", "swa_loc_out") if want.get(k) is not None)


def measure(backend: str, op: str, n: int, args) -> dict:
    a = make_inputs(op, n, args.page_size, args.pages, args.heads,
                    torch.Generator().manual_seed(n), args.dialect)
    matches = None if backend == "torch" else outputs_match_torch(backend, op, a, args.dialect)
    t = bc.time_op(lambda: call(backend, op, a, args.dialect), args.warmup, args.reps).summary()
    moved = moved_bytes(op, a)
    peak = peak_hbm_bytes_per_s()
    return {"op": op, "backend": backend, "n": n,
            **{k: t[k] for k in ("p50_us", "p90_us", "min_us", "reps", "clock")},
            "bytes": moved, "gb_per_s": round(moved / t["p50_us"] / 1e3, 4),
            "hbm_fraction": round(moved / (t["p50_us"] * 1e-6) / peak, 5) if peak else None,
            "matches_torch": matches}


def parse_args(argv=None):
    p = bc.parser(__doc__.split("\n")[0], "results/bench_set_kv.json")
    p.add_argument("--ns", type=bc.int_list, default=[1, 8, 64, 256],
                   help="rows per call (default 1,8,64,256)")
    p.add_argument("--backends", default=None,
                   help="comma-separated of torch,triton,hip (default: all that run here; "
                        "triton on a CPU only when named)")
    p.add_argument("--page-size", type=int, default=256, help="page size in tokens (default 256)")
    p.add_argument("--heads", type=int, default=0,
                   help="q heads normalized in place by fused_k_norm_rope_store (default 0)")
    args = p.parse_args(argv)
    bc.resolve_repetitions(args)
    asked = args.backends is not None
    args.backends = (args.backends or ",".join(BACKENDS)).split(",")
    bc.check_choices(p, "backends", args.backends, BACKENDS)
    args.asked = asked
    args.dialect = fp8_dialect()         # the platform's (DSV4_FP8_DIALECT overrides), read once
    args.pages = -(-4 * max(args.ns) // args.page_size) + 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = {k: getattr(args, k) for k in ("ns", "backends", "page_size", "pages", "heads",
                                            "warmup", "reps")}
    config["fp8_dialect"] = args.dialect.name
    config["triton_interpret"] = triton_interpreted()
    record = bc.new_record("bench_set_kv", args, config)
    record["peak_hbm_bytes_per_s"] = peak_hbm_bytes_per_s()
    skipped = {b: r for b in args.backends if (r := skip_reason(b, args.asked))}
    record["skipped"] = skipped
    record["notes"] = []
    if "triton" in args.backends and "triton" not in skipped and not bc.on_gpu():
        record["notes"].append(INTERPRETER_NOTE)
    cases = [(op, b, n) for op in OPS for b in args.backends for n in args.ns
             if b not in skipped and (b != "hip" or op in HIP_OPS)]
    rows = []
    with torch.no_grad(), bc.progress(len(cases), "set-KV", args.no_progress) as bar:
        for op, backend, n in cases:
            bar.set_postfix_str(f"{op} {backend} n={n}")
            rows.append(measure(backend, op, n, args))
            bar.update()
    record["results"] = rows
    bc.write_kernel_record(args.out, record, skipped)
    print(f"{'op':34s} {'backend':7s} {'n':>4s} {'p50 us':>10s} {'GB/s':>9s} {'HBM':>6s} ok")
    for r in rows:
        hbm = f"{r['hbm_fraction']:.1%}" if r["hbm_fraction"] is not None else "-"
        ok = "-" if r["matches_torch"] is None else ("yes" if r["matches_torch"] else "NO")
        print(f"{r['op']:34s} {r['backend']:7s} {r['n']:4d} {r['p50_us']:10.1f} "
              f"{r['gb_per_s']:9.3f} {hbm:>6s} {ok}")
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
