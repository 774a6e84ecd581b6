"""The mixture of experts: sqrt-softplus gate with a selection bias or token-id hash routing,
SwiGLU experts with the clamp (gate = min(w1 x, limit), up = clamp(w3 x, -limit, limit)), and the
shared expert, which takes the same clamp (docs/decode_path.md section 1, step 6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hip_kernels import aiter_ops, moe_route, moe_routed, moe_shared
from hip_kernels.options import DEFAULT_KERNEL_OPTIONS, KernelOptions

from ..options import Options
from ..parallel import SINGLE, TensorSplit, sum_over_ranks
from .quant_linear import frozen, make_linear


class Gate(nn.Module):
    def __init__(self, cfg, layer_id: int, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.topk = cfg.n_activated_experts
        self.score_func = cfg.score_func
        self.route_scale = cfg.route_scale
        self.hash = cfg.is_hash_layer(layer_id)
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.dim, dtype=dtype,
                                               device=device))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk,
                                                        dtype=torch.int64, device=device))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32,
                                                 device=device))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor,
                options: Options) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [N, k], expert indices int64 [N, k]): one ``hip_kernels.moe_route`` op
        (logits, scores, top-k or hash lookup, weights); a biased gate runs its routing on aiter
        (``aiter_ops.moe_gate``, after the logits) where options.kernel.aiter and the numerics
        allow it."""
        if not self.hash and aiter_ops.use_aiter("moe_gate", self.weight, self.bias,
                                                 aiter=options.kernel.aiter,
                                                 numerics=options.numerics):
            logits = F.linear(x.float(), self.weight.float())
            routed = aiter_ops.moe_gate(logits, self.bias, self.topk, self.route_scale,
                                        self.score_func, numerics=options.numerics,
                                        kernel=options.kernel)
            if routed is not None:
                return routed
        return moe_route(x, self.weight, self.topk, self.route_scale, self.score_func,
                         bias=self.bias, tid2eid=getattr(self, "tid2eid", None),
                         input_ids=input_ids if self.hash else None, kernel=options.kernel)


class Expert(nn.Module):
    """The shared expert (FP8 linears when native)."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float,
                 dtype: torch.dtype = torch.bfloat16, device=None, native: bool = False):
        super().__init__()
        self.w1 = make_linear(dim, inter_dim, native, dtype, device)
        self.w2 = make_linear(inter_dim, dim, native, dtype, device)
        self.w3 = make_linear(dim, inter_dim, native, dtype, device)
        self.swiglu_limit = swiglu_limit
        self.native = native

    def mlp_weights(self) -> dict:
        """w1, w3, w2 (+ their FP8 scales when native): the weight arguments of
        ``hip_kernels.moe_shared``."""
        out = {n: getattr(self, n).weight for n in ("w1", "w3", "w2")}
        if self.native:
            out.update({f"{n}_scale": getattr(self, n).scale for n in ("w1", "w3", "w2")})
        return out


class RoutedExperts(nn.Module):
    """The routed experts' weights, stacked by expert: w1, w3 [E, inter, dim], w2 [E, dim, inter]
    (each expert's matrix in nn.Linear's [out, in] layout). State dicts name them per expert, as
    checkpoints do (``{e}.w1.weight``, views of the stacked tensors), so loading, saving and
    seeded initialisation see the same names and shapes as a list of per-expert modules.

    native: the published FP4 format, e2m1 codes packed two a byte as int8 [E, out, in/2] (element
    2i in the low nibble) with one ue8m0 scale per 32 inputs, ``w1_scale`` [E, out, in/32]
    (``{e}.w1.scale`` in state dicts).

    first: the model-wide index of expert 0 here (a tensor-parallel rank holds n_experts experts
    from there on; state dicts name them by their model-wide index)."""

    PROJECTIONS = ("w1", "w2", "w3")
    FP4_BLOCK = 32

    def __init__(self, n_experts: int, dim: int, inter_dim: int, dtype=torch.bfloat16,
                 device=None, native: bool = False, first: int = 0):
        super().__init__()
        self.n_experts = n_experts
        self.first = first
        self.native = native
        shapes = {"w1": (inter_dim, dim), "w2": (dim, inter_dim), "w3": (inter_dim, dim)}
        for name, (n, k) in shapes.items():
            if native:
                self.register_parameter(name, frozen((n_experts, n, k // 2), torch.int8, device))
                self.register_parameter(name + "_scale", frozen(
                    (n_experts, n, k // self.FP4_BLOCK), torch.float8_e8m0fnu, device))
            else:
                self.register_parameter(name, nn.Parameter(torch.empty(n_experts, n, k,
                                                                       dtype=dtype, device=device)))
        self._register_state_dict_hook(_per_expert_entries)
        self._register_load_state_dict_pre_hook(_stacked_entries, with_module=True)

    def mlp_weights(self) -> dict:
        """w1, w3, w2 (+ their FP4 scales when native): the weight arguments of
        ``hip_kernels.moe_routed``."""
        names = ("w1", "w3", "w2")
        return {p: getattr(self, p) for p in names
                + (tuple(n + "_scale" for n in names) if self.native else ())}

    def entries(self):
        """(stacked parameter, per-expert state-dict suffix) pairs: ("w1", "w1.weight"), and
        when native ("w1_scale", "w1.scale"), ..."""
        leaves = (("", "weight"), ("_scale", "scale")) if self.native else (("", "weight"),)
        return [(name + suffix, f"{name}.{leaf}") for name in self.PROJECTIONS
                for suffix, leaf in leaves]


def _per_expert_entries(module: RoutedExperts, state_dict, prefix, local_metadata) -> None:
    for param, leaf in module.entries():
        stacked = state_dict.pop(prefix + param)
        for e in range(module.n_experts):
            state_dict[f"{prefix}{module.first + e}.{leaf}"] = stacked[e]


def _stacked_entries(module: RoutedExperts, state_dict, prefix, *args) -> None:
    """load_state_dict: gather the per-expert entries into the stacked ones."""
    for param, leaf in module.entries():
        keys = [k for k in state_dict if k.startswith(prefix) and k.endswith(f".{leaf}")
                and k[len(prefix):].split(".")[0].isdigit()]
        if keys:
            keys.sort(key=lambda k: int(k[len(prefix):].split(".")[0]))
            state_dict[prefix + param] = torch.stack([state_dict.pop(k) for k in keys])


class MoE(nn.Module):
    """Routed experts run as grouped GEMMs over the (token, expert) pairs sorted by expert: the
    shapes depend only on the batch (pairs = tokens x top-k), the group offsets stay on the
    device, so a step needs no host read and a graph can hold it. native: the routed experts in
    FP4 (``hip_kernels.fp4_grouped_linear``), the shared expert in FP8, as the reference's FP8
    mode computes them."""

    def __init__(self, cfg, layer_id: int, dtype: torch.dtype = torch.bfloat16, device=None,
                 native: bool = False, split: TensorSplit = SINGLE):
        """split: this tensor-parallel rank holds n_local_experts routed experts from
        first_expert on (the gate and the shared expert whole); ``sum_routed_over_ranks`` adds
        the ranks' routed outputs."""
        super().__init__()
        self.split = split
        self.n_experts = cfg.n_routed_experts
        self.n_local_experts = split.part(cfg.n_routed_experts, "n_routed_experts")
        self.first_expert = split.start(cfg.n_routed_experts)
        self.swiglu_limit = cfg.swiglu_limit
        self.gate = Gate(cfg, layer_id, dtype, device)
        self.experts = RoutedExperts(self.n_local_experts, cfg.dim, cfg.moe_inter_dim, dtype,
                                     device, native, self.first_expert)
        self.shared_experts = (Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit, dtype, device,
                                      native) if cfg.n_shared_experts else None)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
               kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
        """sum over each token's chosen experts of weight * expert(x), fp32 [N, dim], one
        ``hip_kernels.moe_routed`` op; per token the experts are added in ascending expert
        order."""
        return moe_routed(x, weights, indices, **self.experts.mlp_weights(),
                          swiglu_limit=self.swiglu_limit, kernel=kernel)

    def local_routing(self, weights: torch.Tensor, indices: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing among this tensor-parallel rank's experts: indices made local, and a
        pair whose expert another rank holds sent to local expert 0 with weight 0 (it adds an
        exact 0, and the shapes stay the batch's, so a graph holds the step). The identity on one
        rank."""
        if self.n_local_experts == self.n_experts:
            return weights, indices
        local = indices - self.first_expert
        mine = (local >= 0) & (local < self.n_local_experts)
        return weights.masked_fill(~mine, 0.0), local.masked_fill(~mine, 0)

    def sum_routed_over_ranks(self, y: torch.Tensor) -> torch.Tensor:
        """The routed experts' fp32 output summed over the ranks (each ran its own experts:
        the reference's all_reduce, before the shared expert is added); y itself on one rank."""
        return sum_over_ranks(y, self.split)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, options: Options) -> torch.Tensor:
        """gate, routed experts, shared expert: three ops (``moe_route``, ``moe_routed``,
        ``moe_shared``)."""
        weights, indices = self.local_routing(*self.gate(x, input_ids, options))
        y = self.sum_routed_over_ranks(self.routed(x, weights, indices, options.kernel))
        if self.shared_experts is None:
            return y.to(x.dtype)
        return moe_shared(y, x, **self.shared_experts.mlp_weights(),
                          swiglu_limit=self.swiglu_limit, kernel=options.kernel)

