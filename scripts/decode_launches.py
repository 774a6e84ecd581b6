"""Dispatcher ops per decoder layer of one eager decode step, and the bytes that bound the step.

Ops (``count_decode_step``): the whole decode step and the model forward inside it, counted
with ``bench_common.count_launches`` (a CPU's dispatcher ops, a GPU's device kernels), and each
decoder layer's forward on its own (``LayerOps``) with ``bench_common.count_dispatcher_ops``
(the outermost dispatcher ops below autograd, less views and allocations: one launch each on a
GPU) on any device. forward_ops_per_layer is the forward's count over the layers (the
embedding, metadata, final norm and head included), as issue 26 counts a layer.

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


def decode_layer_ops(model, concurrency: int, context_len: int, seed: int = 0) -> dict:
    """`count_decode_step` of an eager engine over ``concurrency`` random prompts of
    ``context_len`` ids."""
    from dsv4.engine import Engine

    engine = Engine(model, max_batch=concurrency, max_context_len=context_len + 4, graph=False)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, model.config.vocab_size, (concurrency, context_len),
                            generator=g).tolist()
    return count_decode_step(engine, prompts)


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
