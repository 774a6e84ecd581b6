"""The mixture of experts: sqrt-softplus gate with a selection bias or token-id hash routing,
SwiGLU experts with the clamp (gate = min(w1 x, limit), up = clamp(w3 x, -limit, limit)), and the
shared expert, which takes the same clamp (docs/decode_path.md section 1, step 6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hip_kernels.capture import is_capturing

from .linear import Linear


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

    def forward(self, x: torch.Tensor,
                input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [N, k], expert indices int64 [N, k])."""
        scores = F.linear(x.float(), self.weight.float())
        if self.score_func == "softmax":
            scores = scores.softmax(-1)
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        if self.hash:
            indices = self.tid2eid[input_ids.long()]
        else:
            indices = (scores + self.bias).topk(self.topk, dim=-1)[1]
        weights = scores.gather(1, indices)
        if self.score_func != "softmax":
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.route_scale, indices


class Expert(nn.Module):
    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype=dtype, device=device)
        self.w2 = Linear(inter_dim, dim, dtype=dtype, device=device)
        self.w3 = Linear(dim, inter_dim, dtype=dtype, device=device)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.w1(x).float()
        up = self.w3(x).float()
        if self.swiglu_limit > 0:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg, layer_id: int, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.gate = Gate(cfg, layer_id, dtype, device)
        self.experts = nn.ModuleList(
            Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit, dtype, device)
            for _ in range(cfg.n_routed_experts))
        self.shared_experts = (Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit, dtype, device)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x, input_ids)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if is_capturing():
            # No data-dependent shapes while a graph is captured: every expert sees every row,
            # with weight 0 where it was not chosen (same sum, same order as the loop below).
            dense = torch.zeros(x.shape[0], self.n_experts, dtype=torch.float32, device=x.device)
            dense.scatter_(1, indices, weights)
            for e, expert in enumerate(self.experts):
                y += expert(x, dense[:, e:e + 1])
        else:
            counts = torch.bincount(indices.flatten(), minlength=self.n_experts).tolist()
            for e, expert in enumerate(self.experts):
                if counts[e]:
                    rows, slot = torch.where(indices == e)
                    y[rows] += expert(x[rows], weights[rows, slot, None])
        if self.shared_experts is not None:
            y += self.shared_experts(x)
        return y.to(x.dtype)
