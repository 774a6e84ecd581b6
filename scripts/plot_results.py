"""PNG plots of a results directory (needs matplotlib: `pip install -e ".[bench]"`).

Writes, for the files present:
  swa_translation.png   us per decode step vs batch, one line per method, a panel per
                        (model, mode), with the 8 us/layer anchor as a dashed line
  set_kv.png            p50 us vs N, one line per (op, backend)
  <decode file>_itl.png ITL p50 vs concurrency, one line per flag configuration, a panel per
                        context length; <decode file>_tokens_per_s.png likewise for tokens/s
  prefix_cache.png      prefill ms with and without the prefix cache, and the fraction saved,
                        vs the hit rate
  long_context.png      prefill tokens/s and peak memory vs the prompt length, decode step p50
                        (and its HBM floor, on a GPU) vs the context (bench_long_context.py's
                        --plot writes the same figure for one record: plot_long_context_file)
Without matplotlib it prints why and writes nothing (exit status 0): plots are optional.

Run: python scripts/plot_results.py results/<timestamp>
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

MISSING = "matplotlib is not installed: no plots (pip install -e \".[bench]\")"


def _panels(plt, n: int, title: str):
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


def _log_x(ax, values) -> None:
    """A log2 x axis labelled with the values measured."""
    values = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()


def _save(fig, path: Path, written: list[Path]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    written.append(path)


def plot_swa(plt, rec: dict, out_dir: Path, written: list[Path]) -> None:
    anchor = rec.get("anchor_us_per_layer")
    groups = defaultdict(lambda: defaultdict(list))
    for r in rec["results"]:
        groups[(r["model"], r["n_layers"], r["mode"])][r["method"]].append(
            (r["batch"], r["us_per_step_p50"]))
    fig, axes = _panels(plt, len(groups), "SWA slots for all layers: us per decode step (p50)")
    for ax, ((model, n_layers, mode), methods) in zip(axes, sorted(groups.items())):
        for method, points in sorted(methods.items()):
            points.sort()
            ax.plot(*zip(*points), marker="o", label=method)
        if anchor:
            ax.axhline(anchor * n_layers, linestyle="--", color="gray",
                       label=f"anchor {anchor:g} us/layer x {n_layers}")
        ax.set(title=f"{model} ({n_layers} layers), {mode}", xlabel="batch", ylabel="us/step",
               yscale="log")
        _log_x(ax, [b for points in methods.values() for b, _ in points])
        ax.legend(fontsize=7)
    _save(fig, out_dir / "swa_translation.png", written)


def plot_set_kv(plt, rec: dict, out_dir: Path, written: list[Path]) -> None:
    lines = defaultdict(list)
    for r in rec["results"]:
        lines[(r["op"], r["backend"])].append((r["n"], r["p50_us"]))
    fig, axes = _panels(plt, 1, "set-KV ops: p50 us per call")
    for (op, backend), points in sorted(lines.items()):
        points.sort()
        axes[0].plot(*zip(*points), marker="o", label=f"{op} [{backend}]")
    axes[0].set(xlabel="rows N", ylabel="us", yscale="log")
    _log_x(axes[0], [n for points in lines.values() for n, _ in points])
    axes[0].legend(fontsize=7)
    _save(fig, out_dir / "set_kv.png", written)


def plot_decode(plt, name: str, rec: dict, out_dir: Path, written: list[Path]) -> None:
    for metric, label in (("itl_ms_p50", "ITL p50 (ms)"),
                          ("decode_tokens_per_s", "decode tokens/s")):
        contexts = sorted({r["context_len"] for r in rec["results"]})
        fig, axes = _panels(plt, len(contexts), f"{name}: {label}")
        for ax, ctx in zip(axes, contexts):
            lines = defaultdict(list)
            for r in rec["results"]:
                if r["context_len"] == ctx:
                    lines[r["config"]].append((r["concurrency"], r[metric]))
            for config, points in sorted(lines.items()):
                points.sort()
                ax.plot(*zip(*points), marker="o", label=config)
            ax.set(title=f"context {ctx}", xlabel="concurrency", ylabel=label)
            _log_x(ax, [c for points in lines.values() for c, _ in points])
            ax.legend(fontsize=7)
        suffix = "itl" if metric == "itl_ms_p50" else "tokens_per_s"
        _save(fig, out_dir / f"{name}_{suffix}.png", written)


def plot_prefix_cache(plt, rec: dict, out_dir: Path, written: list[Path]) -> None:
    rows = sorted(rec["results"], key=lambda r: (r["hit_rate"], r["shared_fraction"]))
    hit = [100 * r["hit_rate"] for r in rows]
    c = rec["config"]
    fig, (left, right) = _panels(plt, 2, f"prefix cache, tiny preset: {c['batch']} x "
                                         f"{c['prompt_len']} tokens, pages of {c['page_size']}")
    left.plot(hit, [r["prefill_ms_uncached"] for r in rows], marker="o", label="no cache")
    left.plot(hit, [r["prefill_ms_cached"] for r in rows], marker="o", label="prefix cache")
    left.set_xlabel("prefix hit rate (% of prompt tokens)")
    left.set_ylabel("prefill ms (median)")
    left.set_ylim(bottom=0)
    left.legend()
    right.plot(hit, [100 * r["saved_fraction"] for r in rows], marker="o")
    right.plot([0, 100], [0, 100], linestyle="--", color="gray", label="saved = hit rate")
    right.set_xlabel("prefix hit rate (% of prompt tokens)")
    right.set_ylabel("prefill time saved (%)")
    right.legend()
    _save(fig, out_dir / "prefix_cache.png", written)


def plot_long_context(plt, rec: dict, path: Path, written: list[Path]) -> None:
    rows = sorted(rec["results"], key=lambda r: r["prompt_len"])
    lens = [r["prompt_len"] for r in rows]
    c = rec["config"]
    fig, (prefill, memory, decode) = _panels(
        plt, 3, f"{rec['machine']}: {rec['model']['note']}, one request, "
                f"{'graphs' if c['graph'] else 'eager'}")
    prefill.plot(lens, [r["prefill_tokens_per_s"] for r in rows], marker="o")
    prefill.set(title="prefill", xlabel="prompt tokens", ylabel="prompt tokens/s")
    for key, label in (("peak_rss_bytes", "peak RSS"), ("peak_device_bytes",
                                                         "peak device allocated")):
        if any(r[key] is not None for r in rows):
            memory.plot(lens, [r[key] / 2 ** 30 for r in rows], marker="o", label=label)
    memory.set(title="peak memory", xlabel="prompt tokens", ylabel="GiB")
    memory.legend(fontsize=7)
    decode.plot(lens, [r["decode_ms_p50"] for r in rows], marker="o", label="decode step p50")
    if any(r["floor_ms"] for r in rows):
        decode.plot(lens, [r["floor_ms"] for r in rows], linestyle="--", color="gray",
                    label=f"HBM floor at {rec['hbm_bytes_per_s'] / 1e12:g} TB/s")
    decode.set(title="decode", xlabel="context tokens", ylabel="ms per step")
    decode.legend(fontsize=7)
    for ax in (prefill, memory, decode):
        _log_x(ax, lens)
        ax.set_ylim(bottom=0)
    _save(fig, path, written)


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and why, printed) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(MISSING)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_long_context_file(rec: dict, path: Path) -> list[Path]:
    """bench_long_context's figure of one record, at path (none without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return []
    written: list[Path] = []
    plot_long_context(plt, rec, Path(path), written)
    plt.close("all")
    for p in written:
        print(f"wrote {p}")
    return written


def plot_all(results_dir: Path) -> list[Path]:
    """The PNGs written (none without matplotlib or results)."""
    plt = _pyplot()
    if plt is None:
        return []
    written: list[Path] = []
    swa = results_dir / "bench_swa_translation.json"
    if swa.exists():
        plot_swa(plt, json.loads(swa.read_text()), results_dir, written)
    set_kv = results_dir / "bench_set_kv.json"
    if set_kv.exists():
        plot_set_kv(plt, json.loads(set_kv.read_text()), results_dir, written)
    prefix = results_dir / "bench_prefix_cache.json"
    if prefix.exists():
        plot_prefix_cache(plt, json.loads(prefix.read_text()), results_dir, written)
    long_context = results_dir / "bench_long_context.json"
    if long_context.exists():
        rec = json.loads(long_context.read_text())
        if rec["results"]:
            plot_long_context(plt, rec, results_dir / "long_context.png", written)
    for path in sorted(results_dir.glob("bench_decode*.json")):
        rec = json.loads(path.read_text())
        if rec["results"]:
            plot_decode(plt, path.stem, rec, results_dir, written)
    plt.close("all")
    for path in written:
        print(f"wrote {path}")
    return written


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results_dir", type=Path, help="a results/<timestamp> directory")
    args = p.parse_args(argv)
    if not args.results_dir.is_dir():
        p.error(f"{args.results_dir} is not a directory")
    return plot_all(args.results_dir)


if __name__ == "__main__":
    main()
