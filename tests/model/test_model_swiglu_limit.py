"""The SwiGLU clamp of the experts (config swiglu_limit): a positive limit clamps the gate from
above and the up projection on both sides; 0 means no clamp at all (the config's documented
meaning), not a clamp to 0. Checked on the shared expert and the routed experts, float32 weights
so the reference matches up to summation order (1e-4 on outputs of size ~100)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dsv4.config import ModelConfig
from dsv4.layers.moe import Expert, MoE
from hip_kernels import moe_shared

DIM, INTER = 16, 8


def swiglu(x, w1, w2, w3, limit):
    gate, up = x @ w1.T, x @ w3.T
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (F.silu(gate) * up) @ w2.T


def weights(gen, *shape):
    return torch.randn(*shape, generator=gen) * 2   # gate and up reach well past 1


@pytest.mark.parametrize("limit", [0.0, 1.0])
def test_shared_expert_clamps_only_for_a_positive_limit(limit):
    gen = torch.Generator().manual_seed(0)
    expert = Expert(DIM, INTER, swiglu_limit=limit, dtype=torch.float32)
    with torch.no_grad():
        for linear, shape in ((expert.w1, (INTER, DIM)), (expert.w2, (DIM, INTER)),
                              (expert.w3, (INTER, DIM))):
            linear.weight.copy_(weights(gen, *shape))
    x = torch.randn(5, DIM, generator=gen)
    with torch.no_grad():   # what MoE.forward adds to the routed sum (zero here)
        got = moe_shared(torch.zeros(5, DIM), x, **expert.mlp_weights(), swiglu_limit=limit)
    want = swiglu(x, expert.w1.weight, expert.w2.weight, expert.w3.weight, limit)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    unclamped = swiglu(x, expert.w1.weight, expert.w2.weight, expert.w3.weight, 0.0)
    assert (limit == 0) == torch.allclose(got, unclamped, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("limit", [0.0, 1.0])
def test_routed_experts_clamp_only_for_a_positive_limit(limit):
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dim=DIM, moe_inter_dim=INTER,
                              n_routed_experts=3, swiglu_limit=limit)
    moe = MoE(cfg, layer_id=cfg.n_hash_layers, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            p = getattr(moe.experts, name)
            p.copy_(weights(gen, *p.shape))
    x = torch.randn(4, DIM, generator=gen)
    indices = torch.tensor([[0, 2], [1, 0], [2, 1], [2, 0]])
    route_w = torch.rand(4, 2, generator=gen)
    with torch.no_grad():
        got = moe.routed(x, route_w, indices)
    w = moe.experts
    want = torch.stack([
        sum(route_w[t, j] * swiglu(x[t:t + 1], w.w1[e], w.w2[e], w.w3[e], limit)[0]
            for j, e in enumerate(indices[t].tolist()))
        for t in range(4)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
