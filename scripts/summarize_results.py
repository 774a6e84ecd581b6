"""Markdown summary of a results directory, with the published anchors beside our numbers.

Reads what is there (any of bench_swa_translation.json, bench_set_kv.json, bench_decode*.json,
env.json) and scripts/anchors.json, and writes DIR/summary.md (or --out). Missing files are
listed, not fatal. Sections: environment; SWA translation (per-layer cost vs the 8 us/layer
anchor, what the identity-keyed cache saves per step, the marginal cost of translating inside the
set-KV kernel); set-KV kernels; decode (ITL and tokens/s per flag configuration); published
anchors (per-token latency on MI355X, B200, H100 and H200 throughput) with a rough layer-count
extrapolation of our ITL where the model was cut; errors.

Run: python scripts/summarize_results.py results/<timestamp> [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ANCHORS = Path(__file__).with_name("anchors.json")
TRANSLATION_ANCHOR = "sglang_pr26931_swa_loc_cache"


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def table(header: list[str], rows: list[list]) -> list[str]:
    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return out + [""]


def environment_section(env: dict | None) -> list[str]:
    if env is None:
        return ["## Environment", "", "No environment record found.", ""]
    plat = env.get("platform", {})
    rows = [["device", env.get("gpu_name") or "CPU only"], ["architecture", env.get("gpu_arch")],
            ["fp8 dialect", plat.get("fp8_dialect")], ["ROCm/HIP", env.get("hip")],
            ["CUDA", env.get("cuda")], ["torch", env.get("torch")], ["triton", env.get("triton")],
            ["git commit", env.get("git_commit")],
            ["non-default flags", ", ".join(f"{k}={v['value']}" for k, v in
                                            env.get("flags", {}).items()
                                            if v.get("source") == "env") or "none"]]
    out = ["## Environment", ""] + table(["", ""], rows)
    if env.get("rocm_smi_productname"):
        out += ["rocm-smi --showproductname:", "", "```", env["rocm_smi_productname"], "```", ""]
    return out


def translation_section(rec: dict, anchor: dict | None) -> list[str]:
    ref = anchor["values"]["translate_us_per_layer"] if anchor else None
    out = ["## SWA translation per decode step", "",
           f"Launch counter: `{rec.get('launch_counter')}`; graph backend: "
           f"`{rec.get('graph_backend')}`. "
           + (f"Anchor: {ref:g} us/layer, {anchor['values']['kernels_per_layer']} kernels per "
              f"layer for the naive per-layer translation on {anchor['hardware']} "
              f"([{anchor['title']}]({anchor['source']})): {ref * 43 / 1000:.2f} ms/step for "
              f"43 layers, {ref * 61 / 1000:.2f} ms for 61." if ref else ""), ""]
    by = {(r["model"], r["batch"], r["mode"], r["method"]): r for r in rec["results"]}
    rows = []
    for d in rec.get("derived", []):
        key = (d["model"], d["batch"], d["mode"])

        def us(method):
            r = by.get(key + (method,))
            return r["us_per_step_p50"] if r else None

        per_layer = d.get("translate_us_per_layer")
        rows.append([d["model"], d["n_layers"], d["batch"], d["mode"], us("per_layer"),
                     us("start_layer"), us("identity_cache"), per_layer,
                     round(per_layer / ref, 2) if per_layer is not None and ref else None,
                     d.get("launches_saved_per_step"), d.get("fused_marginal_us_per_layer")])
    out += table(["model", "layers", "batch", "mode", "(a) per layer us/step",
                  "(b) start layer us/step", "(c) identity cache us/step",
                  "(a) us/layer", "(a) / anchor", "launches saved/step",
                  "(d) fused marginal us/layer"], rows)
    return out


def set_kv_section(rec: dict) -> list[str]:
    rows = [[r["op"], r["backend"], r["n"], r["p50_us"], r.get("gb_per_s"),
             r.get("hbm_fraction"), r.get("matches_torch")] for r in rec["results"]]
    out = ["## Set-KV kernels", ""]
    out += table(["op", "backend", "N", "p50 us", "GB/s", "HBM fraction", "matches torch"], rows)
    return out + [f"- {n}" for n in rec.get("notes", [])] + [
        f"- {b} skipped: {why}" for b, why in rec.get("skipped", {}).items()] + [""]


def decode_section(name: str, rec: dict) -> list[str]:
    model = rec.get("model") or {}
    out = [f"## Decode ({name})", "", f"Model: {model.get('note', 'unknown')}.", ""]
    rows = [[r["config"], r["concurrency"], r["context_len"], r["itl_ms_p50"], r["itl_ms_p90"],
             r["decode_tokens_per_s"], r.get("itl_p50_vs_default"),
             r["swa_translations_per_step"], r["graph_used"]]
            for r in sorted(rec["results"], key=lambda r: (r["context_len"], r["concurrency"]))]
    out += table(["config", "concurrency", "context", "ITL p50 ms", "ITL p90 ms", "tok/s",
                  "ITL p50 / default", "SWA translations/step", "graph used"], rows)
    return out + [f"- {n}" for n in rec.get("notes", [])] + ([""] if rec.get("notes") else [])


def full_depth_itl(rec: dict) -> list[list]:
    """Our best default-config ITL per concurrency, scaled linearly from the layers run to the
    preset's full depth (a rough extrapolation: embedding, head and sampling do not scale)."""
    model = rec.get("model") or {}
    if not model or model.get("preset") == "tiny":
        return []
    scale = model["n_layers_full"] / model["n_layers"]
    rows = []
    for r in rec["results"]:
        if r["config"] == "default":
            rows.append([f"this backend, {model['preset']} x{scale:.1f} layers (extrapolated)",
                         rec.get("env", {}).get("gpu_name"), r["concurrency"], r["context_len"],
                         round(r["itl_ms_p50"] * scale, 2), None])
    return rows


def anchors_section(anchors: dict, decodes: dict[str, dict]) -> list[str]:
    rows = []
    for a in anchors["anchors"]:
        if a["kind"] != "decode":
            continue
        v = a["values"]
        rows.append([f"[{a['title']}]({a['source']})", a["hardware"], a.get("concurrency"),
                     a.get("workload"), v.get("ms_per_token_per_user"),
                     v.get("tok_s_per_gpu") or v.get("tok_s_aggregate")])
    for rec in decodes.values():
        rows += full_depth_itl(rec)
    out = ["## Published anchors", ""]
    out += table(["source", "hardware", "concurrency", "workload", "ms/token/user",
                  "tok/s per GPU (or aggregate)"], rows)
    return out + [f"- {m}" for m in anchors.get("missing", [])] + [
        "- Anchors are full models on multi-GPU serving stacks with real weights; ours are "
        "random weights on one device, so they place our numbers, they do not rank them.", ""]


def errors_section(records: dict[str, dict]) -> list[str]:
    rows = [[name, e.get("config"), e.get("concurrency"), e.get("context_len"),
             e["error"].replace("\n", " ")[:200]]
            for name, rec in records.items() for e in rec.get("errors", [])]
    return (["## Errors", ""] + table(["file", "config", "concurrency", "context", "error"], rows)
            if rows else [])


def summarize(results_dir: Path) -> str:
    anchors = json.loads(ANCHORS.read_text())
    anchor = next((a for a in anchors["anchors"] if a["id"] == TRANSLATION_ANCHOR), None)
    swa = load(results_dir / "bench_swa_translation.json")
    set_kv = load(results_dir / "bench_set_kv.json")
    decodes = {p.stem: json.loads(p.read_text())
               for p in sorted(results_dir.glob("bench_decode*.json"))}
    records = {k: v for k, v in [("bench_swa_translation", swa), ("bench_set_kv", set_kv),
                                 *decodes.items()] if v is not None}
    env = load(results_dir / "env.json") or next(
        (r.get("env") for r in records.values()), None)
    out = [f"# Benchmark summary: {results_dir.name}", ""]
    quick = sorted(name for name, r in records.items() if r.get("quick"))
    if quick:
        out += [f"Quick mode (a smoke run, not a measurement): {', '.join(quick)}.", ""]
    missing = [n for n in ("bench_swa_translation", "bench_set_kv", "bench_decode")
               if not any(k.startswith(n) for k in records)]
    if missing:
        out += [f"Missing results: {', '.join(missing)}.", ""]
    out += environment_section(env)
    if swa:
        out += translation_section(swa, anchor)
    if set_kv:
        out += set_kv_section(set_kv)
    for name, rec in decodes.items():
        out += decode_section(name, rec)
    out += anchors_section(anchors, decodes)
    out += errors_section(records)
    return "\n".join(out)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results_dir", type=Path, help="a results/<timestamp> directory")
    p.add_argument("--out", type=Path, default=None, help="default: RESULTS_DIR/summary.md")
    args = p.parse_args(argv)
    if not args.results_dir.is_dir():
        p.error(f"{args.results_dir} is not a directory")
    out = args.out or args.results_dir / "summary.md"
    out.write_text(summarize(args.results_dir))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
