"""The quantized linears at decode shapes per backend, beside torch's bf16 GEMM on the dequantized
weights: time, bytes moved and the fraction of peak HBM bandwidth.

Cases: every linear of DeepSeek-V4's published checkpoints that decode runs quantized, for each
model in --models and tokens M in --tokens: the FP8 linears wq_a, wq_b, wkv, wo_b and the shared
expert's w1 (w3 has its shape) and w2 (`fp8_linear`), and the routed experts' w1 and w2
(`fp4_grouped_linear`: M x 6 (token, expert) rows, each token's 6 experts drawn at random; only
the experts hit get weights, so the bytes are those a real step reads). Backends: torch (the
reference path: exact block sums in float64), always; triton on a GPU, on a CPU only when asked
(--backends torch,triton with TRITON_INTERPRET=1: interpreter times say nothing about a GPU).
Beside each case, "bf16": F.linear (dense) or torch._grouped_mm (experts) on the weights
dequantized to bf16, the unquantized model's cost.

bytes = what an ideal kernel moves per call: the weight (fp8: 1 B, e2m1: 0.5 B per value; bf16:
2 B), its scales, x and the bf16 output. gb_per_s = bytes / p50 (1e9 B/s); hbm_fraction =
bytes / p50 / peak HBM bandwidth (by device name); null on a CPU. max_abs_diff: the largest
difference from the torch backend's output (null for torch and for bf16, which does not
quantize the activations).

Output JSON (beyond bench_common's record keys):
  "peak_hbm_bytes_per_s", "skipped": {backend: why}, "notes"
  "results": one row per (model, layer, backend, tokens): model, layer, op, backend, tokens,
      rows, k, n, experts, p50_us, p90_us, min_us, reps, clock, bytes, gb_per_s, hbm_fraction,
      max_abs_diff

Run: python scripts/bench_gemm.py [--quick] [--out FILE.json] [--tokens 1,4,16,64]
         [--models flash,pro] [--backends torch,triton]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import bench_common as bc
from bench_set_kv import peak_hbm_bytes_per_s, skip_reason
from hip_kernels import KernelOptions, fp4_grouped_linear, fp8_linear, ocp_to_fnuz
from hip_kernels import quant_linear_ref as R
from hip_kernels.platform import FNUZ, fp8_dialect

BACKENDS = ("torch", "triton")
TOP_K = 6
INTERPRETER_NOTE = ("triton ran in its CPU interpreter: its times say nothing about a GPU, and its "
                    "fp32 -> fp8 casts round some values differently from a GPU (the tests "
                    "install a fix), so its max_abs_diff is not the kernel's")


def linears(dim, q_lora, heads, o_groups, o_lora, inter, experts) -> dict:
    """layer -> (K, N, routed experts or 0) of a model's quantized linears."""
    return {"wq_a": (dim, q_lora, 0), "wq_b": (q_lora, heads * 512, 0), "wkv": (dim, 512, 0),
            "wo_b": (o_groups * o_lora, dim, 0), "shared_w1": (dim, inter, 0),
            "shared_w2": (inter, dim, 0), "experts_w1": (dim, inter, experts),
            "experts_w2": (inter, dim, experts)}


MODELS = {"flash": linears(4096, 1024, 64, 8, 1024, 2048, 256),
          "pro": linears(7168, 1536, 128, 16, 1024, 3072, 384),
          "small": linears(512, 256, 2, 2, 128, 256, 16),      # CPU sized
          "quick": linears(256, 128, 1, 1, 128, 128, 8)}       # --quick on a CPU


def kernel_options(backend: str) -> KernelOptions:
    """The KernelOptions of every timed call: no host check of offs (a sync per call), the
    platform's fp8 dialect."""
    return KernelOptions(backend=backend, value_checks=False, fp8_dialect=fp8_dialect())


def fp8_case(k, n, tokens, g):
    dev = bc.device()
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.randint(110, 120, (-(-n // 128), k // 128), generator=g,
                       dtype=torch.uint8).view(torch.float8_e8m0fnu)
    dense = R.e8m0_to_float(ws).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    bf16 = (w.float() * dense).bfloat16().to(dev)
    if kernel_options("auto").fp8_dialect is FNUZ:     # the weights as the load converts them
        w, ws = ocp_to_fnuz(w, ws)
    x = torch.randn(tokens, k, generator=g).bfloat16().to(dev)
    a = {"x": x, "weight": w.to(dev), "weight_scale": ws.to(dev)}
    moved = (w.numel() + ws.numel() + 2 * x.numel() + 2 * tokens * n)
    return (lambda b: fp8_linear(**a, kernel=kernel_options(b)), lambda: F.linear(x, bf16), moved,
            moved + bf16.numel() - w.numel() - ws.numel(), tokens, 0)


def fp4_case(k, n, experts, tokens, g):
    """(token, expert) rows sorted by expert; only the experts hit get weights."""
    dev = bc.device()
    picks = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(tokens)])
    hit, index = picks.flatten().unique(return_inverse=True)
    counts = torch.bincount(index, minlength=hit.numel())
    offs = counts.cumsum(0).to(torch.int32)
    e = hit.numel()
    w = torch.randint(-128, 128, (e, n, k // 2), generator=g, dtype=torch.int8)
    ws = torch.randint(118, 124, (e, n, k // 32), generator=g, dtype=torch.uint8)
    bf16 = (R.e2m1_to_float(w) * R.e8m0_to_float(ws).repeat_interleave(32, -1)).bfloat16()
    bf16 = bf16.transpose(1, 2).to(dev)                # [E, K, N] for _grouped_mm
    rows = tokens * TOP_K
    x = torch.randn(rows, k, generator=g).bfloat16().to(dev)
    a = {"x": x, "weight": w.to(dev), "weight_scale": ws.to(dev), "offs": offs.to(dev)}
    moved = w.numel() + ws.numel() + 2 * x.numel() + 2 * rows * n + 4 * e
    return (lambda b: fp4_grouped_linear(**a, kernel=kernel_options(b)),
            lambda: torch._grouped_mm(x, bf16, offs=a["offs"]), moved,
            moved + 2 * bf16.numel() - w.numel() - ws.numel(), rows, e)


def measure(model: str, layer: str, tokens: int, backends, args) -> list[dict]:
    k, n, experts = MODELS[model][layer]
    g = torch.Generator().manual_seed(tokens * 1000 + k + n)
    run, bf16_run, moved, bf16_moved, rows, hit = (
        fp4_case(k, n, experts, tokens, g) if experts else fp8_case(k, n, tokens, g))
    op = "fp4_grouped_linear" if experts else "fp8_linear"
    want = run("torch").float() if len(backends) > 1 else None
    peak = peak_hbm_bytes_per_s()
    out = []
    for backend in (*backends, "bf16"):
        fn = bf16_run if backend == "bf16" else (lambda b=backend: run(b))
        diff = (None if backend in ("torch", "bf16") or want is None
                else float((run(backend).float() - want).abs().max()))
        t = bc.time_op(fn, args.warmup, args.reps).summary()
        b = bf16_moved if backend == "bf16" else moved
        out.append({"model": model, "layer": layer, "op": "bf16" if backend == "bf16" else op,
                    "backend": backend, "tokens": tokens, "rows": rows, "k": k, "n": n,
                    "experts": hit, **{key: t[key] for key in ("p50_us", "p90_us", "min_us",
                                                               "reps", "clock")},
                    "bytes": b, "gb_per_s": round(b / t["p50_us"] / 1e3, 4),
                    "hbm_fraction": round(b / (t["p50_us"] * 1e-6) / peak, 5) if peak else None,
                    "max_abs_diff": diff})
    return out


def parse_args(argv=None):
    p = bc.parser(__doc__.split("\n")[0], "results/bench_gemm.json")
    p.add_argument("--tokens", type=bc.int_list, default=None,
                   help="tokens per call (default 1,4,16,64 on a GPU; 1,4 on a CPU)")
    p.add_argument("--models", default=None,
                   help="comma-separated of flash,pro,small,quick (default flash,pro on a GPU; "
                        "small on a CPU; quick with --quick on a CPU)")
    p.add_argument("--backends", default=None,
                   help="comma-separated of torch,triton (default: all that run here; triton on "
                        "a CPU only when named)")
    args = p.parse_args(argv)
    bc.resolve_repetitions(args)
    gpu = bc.on_gpu()
    args.tokens = args.tokens or ([1, 4, 16, 64] if gpu else [1, 4])
    default_models = "flash,pro" if gpu else ("quick" if args.quick else "small")
    args.models = (args.models or default_models).split(",")
    bc.check_choices(p, "models", args.models, MODELS)
    args.asked = args.backends is not None
    args.backends = (args.backends or ",".join(BACKENDS)).split(",")
    bc.check_choices(p, "backends", args.backends, BACKENDS)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = {k: getattr(args, k) for k in ("tokens", "models", "backends", "warmup", "reps")}
    record = bc.new_record("bench_gemm", args, config)
    record["peak_hbm_bytes_per_s"] = peak_hbm_bytes_per_s()
    skipped = {b: r for b in args.backends if (r := skip_reason(b, args.asked))}
    record["skipped"] = skipped
    record["notes"] = ([INTERPRETER_NOTE] if "triton" in args.backends
                       and "triton" not in skipped and not bc.on_gpu() else [])
    backends = [b for b in args.backends if b not in skipped]
    cases = [(m, layer, t) for m in args.models for layer in MODELS[m] for t in args.tokens]
    rows = []
    with torch.no_grad(), bc.progress(len(cases), "gemms", args.no_progress) as bar:
        for case in cases:
            bar.set_postfix_str(" ".join(map(str, case)))
            rows += measure(*case, backends, args)
            bar.update()
    record["results"] = rows
    bc.write_kernel_record(args.out, record, skipped)
    print(f"{'model':6s} {'layer':11s} {'backend':7s} {'M':>3s} {'K':>6s} {'N':>6s} "
          f"{'p50 us':>10s} {'GB/s':>9s} {'HBM':>6s} {'max diff':>9s}")
    for r in rows:
        hbm = f"{r['hbm_fraction']:.1%}" if r["hbm_fraction"] is not None else "-"
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.2e}"
        print(f"{r['model']:6s} {r['layer']:11s} {r['backend']:7s} {r['tokens']:3d} {r['k']:6d} "
              f"{r['n']:6d} {r['p50_us']:10.1f} {r['gb_per_s']:9.3f} {hbm:>6s} {diff:>9s}")
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
