"""The MoE's three dispatcher ops (routing, routed experts, shared expert): each torch reference
is the model's pre-fusion chain bit for bit (bf16 weights, and the published FP4 / FP8 formats
through the quantized linears' public ops), agrees with a per-token restatement, runs as one op
per call, and names a bad argument."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from hip_kernels import (KernelOptions, fp4_grouped_linear, fp8_linear, moe_route, moe_routed,
                         moe_shared)
from hip_kernels.moe_fused import biased_gate, gate_scores, gate_weights
from hip_kernels.quant_linear_ref import e2m1_to_float, e8m0_to_float
from hip_kernels.library import op
from hip_kernels.platform import default_device
from op_recorder import backends, op_names
if importlib.util.find_spec("triton") is not None:
    from triton_interp_shim import interpreter_shim  # noqa: F401 (autouse: bf16 rounds as GPUs)

DEV = default_device()   # the GPU where there is one (Triton compiled), else the CPU (interpreted)

N_EXPERTS, K, DIM, INTER, LIMIT = 8, 2, 128, 256, 7.0


def gen(seed):
    return torch.Generator().manual_seed(seed)


def bf16_experts(seed=0, n=N_EXPERTS):
    g = gen(seed)
    return {"w1": (torch.randn(n, INTER, DIM, generator=g) / 8).bfloat16(),
            "w3": (torch.randn(n, INTER, DIM, generator=g) / 8).bfloat16(),
            "w2": (torch.randn(n, DIM, INTER, generator=g) / 16).bfloat16()}


def fp4_experts(seed=0):
    """Random e2m1 codes (two a byte) and ue8m0 scales around 2^-3."""
    g = gen(seed)
    out = {}
    for name, (n, k) in (("w1", (INTER, DIM)), ("w3", (INTER, DIM)), ("w2", (DIM, INTER))):
        out[name] = torch.randint(-128, 128, (N_EXPERTS, n, k // 2), generator=g,
                                  dtype=torch.int8)
        out[name + "_scale"] = torch.randint(122, 126, (N_EXPERTS, n, k // 32), generator=g,
                                             dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return out


def routing(n, seed=1):
    g = gen(seed)
    x = torch.randn(n, DIM, generator=g).bfloat16()
    indices = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:K] for _ in range(n)])
    weights = torch.rand(n, K, generator=g)
    return x, weights, indices


def pre_fusion_routed(x, weights, indices, w, native):
    """MoE.routed before the fusion (the pairs sorted by expert, grouped GEMMs, SwiGLU, weighted
    index_add)."""
    n, k = indices.shape
    expert = indices.flatten()
    order = torch.argsort(expert, stable=True)
    token = order // k
    counts = torch.zeros(N_EXPERTS, dtype=torch.int32)
    counts.scatter_add_(0, expert, torch.ones_like(expert, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)

    def grouped(rows, name):
        if native:
            return fp4_grouped_linear(rows, w[name], w[name + "_scale"], offs)
        return torch._grouped_mm(rows, w[name].transpose(1, 2), offs=offs)

    xs = x[token]
    gate = grouped(xs, "w1").float().clamp(max=LIMIT)
    up = grouped(xs, "w3").float().clamp(-LIMIT, LIMIT)
    h = weights.flatten()[order, None] * (F.silu(gate) * up)
    out = grouped(h.to(x.dtype), "w2")
    return torch.zeros(n, DIM).index_add_(0, token, out.float())


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("n", [1, 8])
def test_routed_is_the_pre_fusion_chain_bit_for_bit(native, n):
    w = fp4_experts() if native else bf16_experts()
    x, weights, indices = routing(n, seed=n)
    got = moe_routed(x, weights, indices, **w, swiglu_limit=LIMIT)
    assert got.dtype == torch.float32 and torch.equal(got, pre_fusion_routed(x, weights, indices,
                                                                             w, native))


def dense_expert(x, w1, w3, w2):
    """One expert on fp32 weights, rounding to bf16 where the model rounds."""
    gate = (x.float() @ w1.float().T).bfloat16().float().clamp(max=LIMIT)
    up = (x.float() @ w3.float().T).bfloat16().float().clamp(-LIMIT, LIMIT)
    return F.silu(gate) * up


def test_routed_agrees_with_a_per_token_loop():
    """bf16 weights: each token's experts one by one (products rounded as the grouped GEMMs
    round them; fp32 sums in another order: to 1e-2 relative)."""
    w = bf16_experts(seed=2)
    x, weights, indices = routing(5, seed=3)
    want = torch.zeros(5, DIM)
    for t in range(5):
        for j in range(K):
            e = int(indices[t, j])
            h = (weights[t, j] * dense_expert(x[t:t + 1], w["w1"][e], w["w3"][e], w["w2"][e]))
            want[t] += (h.bfloat16().float() @ w["w2"][e].float().T).bfloat16().float()[0]
    torch.testing.assert_close(moe_routed(x, weights, indices, **w, swiglu_limit=LIMIT), want,
                               rtol=1e-2, atol=1e-2)


def test_an_expert_no_token_chose_is_never_read_into_the_sum():
    """A NaN in an unrouted expert's weights leaves the output finite."""
    w = bf16_experts(seed=4)
    x, weights, indices = routing(3, seed=5)
    unused = sorted(set(range(N_EXPERTS)) - set(indices.flatten().tolist()))[0]
    w["w1"][unused] = float("nan")
    assert moe_routed(x, weights, indices, **w, swiglu_limit=LIMIT).isfinite().all()


def test_fp4_experts_match_their_dequantized_weights():
    """The FP4 path against the same experts dequantized (e2m1 * 2^(s-127)) in bf16, within the
    activations' FP8 quantization error (a few percent)."""
    w = fp4_experts(seed=6)
    deq = {}
    for name in ("w1", "w3", "w2"):
        codes = e2m1_to_float(w[name].view(torch.uint8))
        scale = e8m0_to_float(w[name + "_scale"]).repeat_interleave(32, -1)
        deq[name] = (codes * scale).bfloat16()
    x, weights, indices = routing(4, seed=7)
    got = moe_routed(x, weights, indices, **w, swiglu_limit=LIMIT)
    want = moe_routed(x, weights, indices, **deq, swiglu_limit=LIMIT)
    assert (got - want).norm() / want.norm() < 0.1


def shared_weights(native, seed=8):
    g = gen(seed)
    w = {"w1": torch.randn(INTER, DIM, generator=g) / 8,
         "w3": torch.randn(INTER, DIM, generator=g) / 8,
         "w2": torch.randn(DIM, INTER, generator=g) / 16}
    if not native:
        return {k: v.bfloat16() for k, v in w.items()}
    out = {}
    for name, v in w.items():
        out[name] = v.to(torch.float8_e4m3fn)
        out[name + "_scale"] = torch.ones(v.shape[0] // 128, v.shape[1] // 128).to(
            torch.float8_e8m0fnu)
    return out


@pytest.mark.parametrize("native", [False, True])
def test_shared_is_the_pre_fusion_chain_bit_for_bit(native):
    """MoE.forward before the fusion: y += Expert(x) (bf16 F.linear or fp8_linear), in x's
    dtype."""
    w = shared_weights(native)
    x, _, _ = routing(3, seed=9)
    routed = torch.randn(3, DIM, generator=gen(10))

    def linear(v, name):
        return fp8_linear(v, w[name], w[name + "_scale"]) if native else F.linear(v, w[name])
    gate = linear(x, "w1").float().clamp(max=LIMIT)
    up = linear(x, "w3").float().clamp(-LIMIT, LIMIT)
    y = routed.clone()
    y += linear((F.silu(gate) * up).to(x.dtype), "w2")
    got = moe_shared(routed, x, **w, swiglu_limit=LIMIT)
    assert got.dtype == torch.bfloat16 and torch.equal(got, y.to(x.dtype))


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route_is_the_gate_chain(score_func):
    g = gen(11)
    x = torch.randn(6, DIM, generator=g).bfloat16()
    gate_w = torch.randn(N_EXPERTS, DIM, generator=g).bfloat16()
    bias = torch.randn(N_EXPERTS, generator=g)
    logits = F.linear(x.float(), gate_w.float())
    weights, indices = moe_route(x, gate_w, K, 2.5, score_func, bias=bias)
    want_w, want_i = biased_gate(logits, bias, K, 2.5, score_func)
    assert torch.equal(weights, want_w) and torch.equal(indices, want_i)
    # each token's experts: the K largest scores + bias
    top = (gate_scores(logits, score_func) + bias).argsort(-1, descending=True)[:, :K]
    assert torch.equal(indices.sort(-1).values, top.sort(-1).values)
    tid2eid = torch.randint(0, N_EXPERTS, (50, K), generator=g)
    ids = torch.randint(0, 50, (6,), generator=g)
    weights, indices = moe_route(x, gate_w, K, 2.5, score_func, tid2eid=tid2eid, input_ids=ids)
    assert torch.equal(indices, tid2eid[ids])
    assert torch.equal(weights, gate_weights(gate_scores(logits, score_func), indices,
                                             score_func, 2.5))


def test_one_dispatcher_op_per_call():
    x, weights, indices = routing(4)
    w = bf16_experts()
    assert op_names(lambda: moe_routed(x, weights, indices, **w, swiglu_limit=LIMIT)) == [
        "dsv4::moe_routed"]
    routed, shared = torch.zeros(4, DIM), shared_weights(False)
    assert op_names(lambda: moe_shared(routed, x, **shared)) == ["dsv4::moe_shared"]
    gate_w, bias = torch.zeros(N_EXPERTS, DIM).bfloat16(), torch.zeros(N_EXPERTS)
    assert op_names(lambda: moe_route(x, gate_w, K, 1.0, "sigmoid", bias=bias)) == [
        "dsv4::moe_route"]


def test_bad_arguments_raise_naming_them():
    x, weights, indices = routing(2)
    w = bf16_experts()
    with pytest.raises(ValueError, match="weights must have shape"):
        moe_routed(x, weights[:, :1], indices, **w)
    with pytest.raises(ValueError, match="all None"):
        moe_routed(x, weights, indices, **w, w1_scale=torch.zeros(1))
    with pytest.raises(ValueError, match="w1/w3 must be"):
        moe_routed(x, weights, indices, **{**w, "w2": w["w2"][:, :, :-1]})
    gate_w = torch.zeros(N_EXPERTS, DIM)
    with pytest.raises(ValueError, match="exactly one of bias"):
        moe_route(x, gate_w, K, 1.0, "sigmoid")
    with pytest.raises(ValueError, match="score_func="):
        moe_route(x, gate_w, K, 1.0, "relu", bias=torch.zeros(N_EXPERTS))
    with pytest.raises(ValueError, match="k=9"):
        moe_route(x, gate_w, 9, 1.0, "sigmoid", bias=torch.zeros(N_EXPERTS))
    with pytest.raises(ValueError, match="routed must have shape"):
        moe_shared(torch.zeros(2, DIM + 1), x, **shared_weights(False))


# ---- Triton kernels (bf16 weights; FP4 / FP8: test_moe_fused_quant.py), in the interpreter --

triton_only = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="needs triton")


def on_dev(d: dict) -> dict:
    return {k: v.to(DEV) for k, v in d.items()}


@triton_only
@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("k", [2, 3])
def test_triton_route_matches_the_reference(score_func, k):
    """The same experts (distinct scores here), weights to 1e-5 relative (exp / log in Triton's
    own rounding, the logits summed in blocks)."""
    g = gen(20 + k)
    x = torch.randn(5, DIM, generator=g).bfloat16().to(DEV)
    gate_w = torch.randn(N_EXPERTS, DIM, generator=g).bfloat16().to(DEV)
    bias = torch.randn(N_EXPERTS, generator=g).to(DEV)
    args = (k, 1.5, score_func)
    want = op("moe_route", "torch")(x, gate_w, bias, None, None, *args)
    got = op("moe_route", "triton")(x, gate_w, bias, None, None, *args)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    tid2eid = torch.randint(0, N_EXPERTS, (30, k), generator=g).to(DEV)
    ids = torch.randint(0, 30, (5,), generator=g).to(DEV)
    want = op("moe_route", "torch")(x, gate_w, None, tid2eid, ids, *args)
    got = op("moe_route", "triton")(x, gate_w, None, tid2eid, ids, *args)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


@triton_only
@pytest.mark.parametrize("n", [1, 3])
def test_triton_routed_and_shared_match_the_reference(n):
    """bf16 products rounded where the reference rounds them, fp32 sums in block order: a
    bf16-rounded intermediate may land one ulp apart, so 2e-2 of the output's scale."""
    w = on_dev(bf16_experts(seed=21))
    x, weights, indices = (t.to(DEV) for t in routing(n, seed=22))
    args = (None, None, None, LIMIT)
    want = op("moe_routed", "torch")(x, weights, indices, w["w1"], w["w3"], w["w2"], *args,
                                     "ocp")
    got = op("moe_routed", "triton")(x, weights, indices, w["w1"], w["w3"], w["w2"], *args,
                                     "ocp")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    s = on_dev(shared_weights(False, seed=23))
    want_s = op("moe_shared", "torch")(want, x, s["w1"], s["w3"], s["w2"], *args)
    got_s = op("moe_shared", "triton")(want, x, s["w1"], s["w3"], s["w2"], *args)
    assert got_s.dtype == torch.bfloat16
    torch.testing.assert_close(got_s.float(), want_s.float(), rtol=2e-2,
                               atol=2e-2 * want_s.abs().max().item())


@triton_only
def test_the_backend_follows_the_options():
    """bf16 weights: Triton when asked, the torch reference by default on a CPU (FP4 / FP8
    weights: test_moe_fused_quant.py)."""
    if DEV.type != "cpu":
        pytest.skip("the CPU backend choice (the interpreter)")
    triton = KernelOptions(backend="triton")
    x, weights, indices = routing(2)

    def backend(fn):
        (used,) = backends(fn)
        return used
    assert backend(lambda: moe_routed(x, weights, indices, **bf16_experts(),
                                      kernel=triton)) == "triton"
    assert backend(lambda: moe_routed(x, weights, indices, **bf16_experts())) == "torch"
