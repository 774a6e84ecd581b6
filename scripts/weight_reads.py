"""Weight bytes one decode step reads, counted on the CPU, and the native active bytes of that step.

Read (``WeightReads``): every op of the step runs under a TorchDispatchMode; a tensor argument
that shares a parameter's storage marks the part of the parameter it spans, by rows of the
parameter's first dim (an expert of a stacked expert tensor, a row of the embedding). View ops
read nothing. A grouped op (an ``offs`` argument: the sorted (token, expert) pairs' group ends)
reads only the experts with rows in it, and so does ``dsv4::moe_routed`` (the experts its
``indices`` name); a gather (embedding, index_select, index) only the rows
it names. The figure is the bytes of the marked rows, each counted once per step.

Native active (``native_active_bytes``): what the same step needs in the published formats
(``dsv4.weights.formats``): every parameter, FP8/FP4 where the checkpoints store them (``wo_a``
bf16), the routed experts only for the experts the step's tokens were routed to (per layer), and
the embedding only for the step's distinct tokens.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hip_kernels  # noqa: F401 (defines the torch.ops.dsv4 ops)
from dsv4.weights.formats import native_bytes

aten = torch.ops.aten
# op -> (argument read by rows, argument holding the row ids)
GATHERS = {aten.embedding.default: ("weight", "indices"),
           aten.index_select.default: ("self", "index"),
           aten.index.Tensor: ("self", "indices")}
ROUTED = torch.ops.dsv4.moe_routed    # the routed experts (any backend), routed by indices


class WeightReads(TorchDispatchMode):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
        self.rows: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view:
            named = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
            for name, value in named.items():
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                        param = self.params.get(t.untyped_storage().data_ptr())
                        if param is not None:
                            self._mark(func, named, name, t, param)
        return func(*args, **kwargs)

    def _mark(self, func, named: dict, name: str, t: torch.Tensor, param) -> None:
        _, rows = self.rows.setdefault(id(param), (param, torch.zeros(
            max(1, param.shape[0] if param.dim() else 1), dtype=torch.bool)))
        gather = GATHERS.get(func)
        offs = named.get("offs")
        if gather is not None and gather[0] == name:
            index = named[gather[1]]
            index = index[0] if isinstance(index, (list, tuple)) else index
            if index is not None:
                rows[index.reshape(-1).long().unique().cpu()] = True
                return
        if offs is not None and param.dim() == 3:
            counts = torch.diff(offs.long().cpu(), prepend=torch.zeros(1, dtype=torch.long))
            rows[:counts.numel()] |= counts > 0
            return
        if func.overloadpacket is ROUTED and param.dim() == 3:
            rows[named["indices"].reshape(-1).cpu().unique()] = True
            return
        if t.numel() == 0:
            return
        row = param.stride(0) if param.dim() else 1
        lo = t.storage_offset() - param.storage_offset()
        hi = lo + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
        rows[lo // row: -(-hi // row)] = True

    def bytes_read(self) -> int:
        return sum(int(rows.sum()) * (p.nbytes // rows.numel()) for p, rows in self.rows.values())


class Routing:
    """The experts each MoE layer's gate picks and the token ids embedded, while in a ``with``."""

    def __init__(self, model):
        self.model = model
        self.experts: dict[int, set[int]] = {}
        self.tokens: set[int] = set()
        self._hooks = []

    def __enter__(self) -> "Routing":
        def gate_hook(layer_id):
            def hook(module, args, out):
                self.experts.setdefault(layer_id, set()).update(out[1].reshape(-1).tolist())
            return hook

        for layer in self.model.layers:
            self._hooks.append(layer.ffn.gate.register_forward_hook(gate_hook(layer.layer_id)))
        self._hooks.append(self.model.embed.register_forward_pre_hook(
            lambda module, args: self.tokens.update(args[0].reshape(-1).tolist())))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()


def native_active_bytes(config, routing: Routing) -> int:
    """Bytes of the published-format weights the step of ``routing`` needs (module docstring)."""
    from dsv4.model import DeepseekV4Model

    shapes = DeepseekV4Model(config, device="meta", weights="bf16")
    total = 0
    for name, p in shapes.named_parameters():
        full = native_bytes(name, tuple(p.shape), p.element_size())
        if ".ffn.experts." in name:
            layer = int(name.split(".")[1])
            total += full // p.shape[0] * len(routing.experts.get(layer, ()))
        elif name == "embed.weight":
            total += full // p.shape[0] * len(routing.tokens)
        else:
            total += full
    return total


def count_decode_step(model, concurrency: int, context_len: int, seed: int = 0) -> dict:
    """Weight bytes read by the second decode step (eager) of ``concurrency`` random prompts of
    ``context_len`` ids, and the native active bytes of that step."""
    from dsv4.engine import Engine

    engine = Engine(model, max_batch=concurrency, max_context_len=context_len + 3, graph=False)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, model.config.vocab_size, (concurrency, context_len),
                            generator=g).tolist()
    real, calls, found = engine._decode_forward, [], {}

    def forward(batch):
        calls.append(1)
        if len(calls) != 2:
            return real(batch)
        with Routing(model) as routing, WeightReads(model) as reads:
            out = real(batch)
        found.update(bytes_read=reads.bytes_read(),
                     native_active_bytes=native_active_bytes(model.config, routing))
        return out

    engine._decode_forward = forward
    engine.generate(prompts, 3)
    return {"weights": model.weights, "concurrency": concurrency, "context_len": context_len,
            **found, "read_vs_native_active": round(found["bytes_read"]
                                                    / found["native_active_bytes"], 4)}
