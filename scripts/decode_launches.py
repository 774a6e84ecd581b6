"""Launches per decoder layer of eager decode steps, counted two ways, and the bytes that bound a
step.

GPU launches (``count_gpu_launches``; ``--count gpu``, the default): what a GPU would launch,
counted on a CPU with Triton's interpreter (``gpu_launches.GpuLaunches``: each Triton launch,
each aten op outside one but views and allocations, a dsv4 op's torch prelude op by op), in each
decoder layer's forward and outside them (the step's metadata, embedding, head, sampling and the
engine's bookkeeping), per decode step. Run it with the Triton backend (``--kernel-backend``,
default triton) so that every op that has a kernel runs it.

Dispatcher ops (``count_decode_step``; ``--count dispatcher``): the whole decode step and the
model forward inside it, counted with ``bench_common.count_launches`` (a CPU's dispatcher ops, a
GPU's device kernels), and each decoder layer's forward on its own (``LayerOps``) with
``bench_common.count_dispatcher_ops`` (the outermost dispatcher ops below autograd, less views
and allocations; a dsv4 op is one op whatever runs inside it) on any device.
forward_ops_per_layer is the forward's count over the layers (the embedding, metadata, final
norm and head included), as issue 26 counts a layer.

Command line: ``python scripts/decode_launches.py [--count gpu|dispatcher] [--preset tiny]
[--batch 2] [--context 16] [--steps 3,4]`` prints a table of the counts (``--out``: JSON too);
the model is ``bench_model.build_model``'s (seeded random weights, native formats where the
preset allows them).

Bytes (``kv_bytes``): the KV rows one decode step reads and writes, from the config alone, per
token of context c (its tokens in the cache once this step's is written): each layer reads
min(c, window) window rows and writes one; a ratio-r layer holds c // r compressed rows, reads
them all (ratio 128) or the indexer's top-k of them plus every indexer row (ratio 4), and writes
one compressed (and indexer) row when this step completes a block of r. Rows in the pool's
layout (``hip_kernels.kv_layout``: 584 bytes a KV row, 132 an indexer row). The compressors'
state rings are not counted. The floor is (weight bytes + KV bytes) / the device's peak
bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import bench_common as bc
from hip_kernels.kv_layout import INDEX_TOKEN_BYTES, TOKEN_BYTES


STEP_KEYS = ("step_ops", "step_syncs", "step_device_syncs", "forward_ops", "forward_syncs",
             "forward_ops_per_layer", "layer_ops", "layer_ops_max")   # count_decode_step's


class LayerOps:
    """The dispatcher ops of each decoder layer's forward calls while in a ``with``:
    ``counts[layer_id]`` is a list of `bench_common.LaunchCount`, one per call."""

    def __init__(self, model):
        self.layers = list(model.layers)
        self.counts: dict[int, list[bc.LaunchCount]] = {}

    def __enter__(self) -> "LayerOps":
        for layer in self.layers:
            layer.forward = self._counted(layer, layer.forward)
        return self

    def _counted(self, layer, forward):
        def run(*args, **kwargs):
            out = []
            count = bc.count_dispatcher_ops(lambda: out.append(forward(*args, **kwargs)))
            self.counts.setdefault(layer.layer_id, []).append(count)
            return out[0]
        return run

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            del layer.forward   # the instance attribute shadowed the class's method


def count_gpu_launches(engine, prompts, steps=(3, 4)) -> dict[int, dict]:
    """`gpu_launches.GpuLaunches` of the given decode steps (1 is the first after the prefill)
    of an eager generate of ``prompts``: {step: {"layers": [Launches of each decoder layer's
    forward], "outside": Launches of the rest of the step}}. The whole ``_decode_step`` is
    counted: the batch's tensors, the forward, sampling and the engine's bookkeeping."""
    from gpu_launches import OUTSIDE, GpuLaunches, Launches

    if engine.graph_runner is not None:
        raise ValueError("count_gpu_launches: engine must be eager (graph=False): a captured "
                         "step replays without launching Triton on a CPU")
    real_step, layers, calls, found = engine._decode_step, list(engine.model.layers), [], {}

    def scoped(layer, counter):
        forward = layer.forward

        def run(*args, **kwargs):
            with counter.scope(f"layer {layer.layer_id}"):
                return forward(*args, **kwargs)
        return run

    def step(*args):
        calls.append(1)
        if len(calls) not in steps:
            return real_step(*args)
        counter = GpuLaunches()
        for layer in layers:
            layer.forward = scoped(layer, counter)
        try:
            with counter:
                real_step(*args)
        finally:
            for layer in layers:
                del layer.forward   # the instance attribute shadowed the class's method
        found[len(calls)] = {
            "layers": [counter.scopes[f"layer {layer.layer_id}"] for layer in layers],
            "outside": counter.scopes.get(OUTSIDE, Launches())}

    engine._decode_step = step
    try:
        engine.generate(prompts, max(steps) + 2)   # the counted steps are not the last: a
        #                                             request's release is per request, not per step
    finally:
        del engine._decode_step
    missing = sorted(set(steps) - set(found))
    if missing:
        raise RuntimeError(f"count_gpu_launches: the generate ran no decode step {missing}")
    return found


def decode_gpu_launches(model, concurrency: int, context_len: int, options, steps=(3, 4),
                        seed: int = 0) -> dict[int, dict]:
    """`count_gpu_launches` of an eager engine with ``options`` (its kernel backend: what runs)
    over ``concurrency`` random prompts of ``context_len`` ids."""
    from dataclasses import replace

    from dsv4.engine import Engine

    engine = Engine(model, max_batch=concurrency, max_context_len=context_len + max(steps) + 2,
                    graph=False, options=replace(options, graph=False))
    return count_gpu_launches(engine, random_prompts(model, concurrency, context_len, seed),
                              steps)


def random_prompts(model, concurrency: int, context_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, model.config.vocab_size, (concurrency, context_len),
                         generator=g).tolist()


def device_state(engine) -> list[torch.Tensor]:
    """The tensors a GPU run keeps on the device: weights, the KV pool's buffers (caches, state
    rings, the full -> SWA map) and the request -> token table."""
    found = [*engine.model.parameters(), *engine.model.buffers(), engine.req_to_token]

    def walk(value):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
    for value in vars(engine.pool).values():
        walk(value)
    return found


def count_decode_step(engine, prompts) -> dict:
    """Ops and host syncs of the second decode step of a 3-token generate (eager), overall and
    inside the model forward, and each layer's dispatcher ops (``LayerOps``). On a GPU the
    profiler cannot nest, so the forward is counted alone in the third decode step (of a
    4-token generate), a step of the same shapes."""
    real_step, real_forward = engine._decode_step, engine._decode_forward
    counts, calls = {}, []
    on_device = device_state(engine)
    forward_step = 3 if bc.on_gpu() else 2

    def forward(batch):
        out = []
        with LayerOps(engine.model) as layers:
            counts["forward"] = bc.count_launches(lambda: out.append(real_forward(batch)),
                                                  on_device)
        counts["layers"] = [layers.counts[layer.layer_id][0].launches
                            for layer in engine.model.layers]
        return out[0]

    def step(*args):
        calls.append(1)
        if len(calls) not in (2, forward_step):
            return real_step(*args)
        if len(calls) == forward_step:
            engine._decode_forward = forward
        try:
            if len(calls) == 2:
                counts["step"] = bc.count_launches(lambda: real_step(*args), on_device)
            else:
                real_step(*args)
        finally:
            engine._decode_forward = real_forward

    engine._decode_step = step
    try:
        engine.generate(prompts, forward_step + 1)
    finally:
        del engine._decode_step
    return {"step_ops": counts["step"].launches, "step_syncs": counts["step"].host_syncs,
            "step_device_syncs": counts["step"].device_syncs,
            "forward_ops": counts["forward"].launches,
            "forward_syncs": counts["forward"].host_syncs,
            "forward_ops_per_layer": round(counts["forward"].launches / len(counts["layers"]), 2),
            "layer_ops": counts["layers"], "layer_ops_max": max(counts["layers"])}


def decode_layer_ops(model, concurrency: int, context_len: int, seed: int = 0,
                     options=None) -> dict:
    """`count_decode_step` of an eager engine (``options``: None reads the DSV4_* flags) over
    ``concurrency`` random prompts of ``context_len`` ids."""
    from dsv4.engine import Engine

    engine = Engine(model, max_batch=concurrency, max_context_len=context_len + 4, graph=False,
                    options=options)
    return count_decode_step(engine, random_prompts(model, concurrency, context_len, seed))


def kv_bytes(config, concurrency: int, context: int) -> dict:
    """{"kv_read_bytes", "kv_written_bytes"} of one decode step of ``concurrency`` requests of
    ``context`` tokens each (this step's included); see the module docstring."""
    read = written = 0
    for layer in range(config.n_layers):
        read += min(context, config.window_size) * TOKEN_BYTES
        written += TOKEN_BYTES
        ratio = config.layer_ratio(layer)
        if not ratio:
            continue
        rows = context // ratio
        completes = context % ratio == 0
        if ratio == 4:
            read += min(rows, config.index_topk) * TOKEN_BYTES + rows * INDEX_TOKEN_BYTES
            written += completes * (TOKEN_BYTES + INDEX_TOKEN_BYTES)
        else:
            read += rows * TOKEN_BYTES
            written += completes * TOKEN_BYTES
    return {"kv_read_bytes": read * concurrency, "kv_written_bytes": written * concurrency}


def floor_ms(step_bytes: int, peak_bytes_per_s: float | None) -> float | None:
    """The time the step's bytes take at the device's peak bandwidth (None without one)."""
    return round(step_bytes / peak_bytes_per_s * 1e3, 4) if peak_bytes_per_s else None


# ---- command line --------------------------------------------------------------------------

def launch_table(found: dict[int, dict], kinds: list[str]) -> str:
    """A markdown table of `count_gpu_launches`: a row per decoder layer (its kind) and one for
    the rest of the step, a column pair (launches, aten ops by name) per step."""
    steps = sorted(found)
    head = "| where | " + " | ".join(f"step {s} | of which aten" for s in steps) + " |"
    rows = [head, "|---|" + "---|---|" * len(steps)]

    def cells(c) -> str:
        ops = ", ".join(f"{n} {k}" for n, k in sorted(c.aten.items(), key=lambda kv: -kv[1]))
        return f"{c.total} | {c.n_aten}{': ' + ops if ops else ''}"

    for i, kind in enumerate(kinds):
        rows.append(f"| layer {i} ({kind}) | "
                    + " | ".join(cells(found[s]["layers"][i]) for s in steps) + " |")
    rows.append("| outside the layers | "
                + " | ".join(cells(found[s]["outside"]) for s in steps) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", choices=("gpu", "dispatcher"), default="gpu",
                   help="gpu: what a GPU would launch (Triton under its interpreter on a CPU); "
                        "dispatcher: the dispatcher ops (count_decode_step)")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--weights", choices=("native", "bf16"), default=None,
                   help="weight formats (default: native where the preset allows it)")
    p.add_argument("--batch", type=int, default=2, help="requests per step (default 2)")
    p.add_argument("--context", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--steps", type=bc.int_list, default=[3, 4],
                   help="decode steps counted, 1 the first after the prefill (default 3,4)")
    p.add_argument("--kernel-backend", default="triton",
                   choices=("auto", "hip", "triton", "torch"),
                   help="DSV4_KERNEL_BACKEND of the run (default triton)")
    p.add_argument("--out", default=None, help="also write the counts as JSON here")
    args = p.parse_args(argv)

    if not bc.on_gpu():
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported
    torch.set_num_threads(1)
    from dataclasses import replace

    from bench_model import build_model
    from dsv4.options import Options

    spec = {"preset": args.preset, "layers": None, "experts": None, "vocab": None,
            "weights": args.weights, "contexts": [args.context],
            "new_tokens": max(args.steps) + 2, "seed": 0}
    model, _ = build_model(spec)
    options = Options.from_env()
    options = replace(options, kernel=replace(options.kernel, backend=args.kernel_backend))
    with torch.no_grad():
        if args.count == "dispatcher":
            record = decode_layer_ops(model, args.batch, args.context, options=options)
            print(json.dumps(record, indent=1))
        else:
            found = decode_gpu_launches(model, args.batch, args.context, options,
                                        tuple(args.steps))
            kinds = [f"ratio {model.config.layer_ratio(i)}" for i in range(model.config.n_layers)]
            print(f"{args.preset} ({model.weights} weights), batch {args.batch}, context "
                  f"{args.context}, kernel backend {args.kernel_backend}\n")
            print(launch_table(found, kinds))
            record = {str(s): {"layers": [c.summary() for c in v["layers"]],
                               "outside": v["outside"].summary()} for s, v in found.items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
