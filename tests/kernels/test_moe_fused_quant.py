"""The fused MoE's Triton kernels for the published weight formats (moe_fused_quant_triton: FP4
routed experts, FP8 shared expert) against the ops' torch references (the pre-fusion chain through
the quantized linears' torch path), in the interpreter on a CPU, on the smallest legal shapes
(D and inter one or two of act_quant's 128-wide blocks).

Tolerance: 2e-2 of the output's largest magnitude. In the interpreter the kernels' partial sums
are exact (float64, EXACT_DOT) and each is the reference's fp32 value, so gate and up are the
reference's bits; SiLU is Triton's sigmoid, so an h value may land one bf16 ulp away, which moves
one fp8 rounding of the down GEMM's input (at a power of two, its 128-block's scale): a few
fp8 steps of one input, well under 2e-2. Measured on these seeds: bit for bit."""

import importlib.util

import pytest
import torch

from hip_kernels import KernelOptions, moe_routed, moe_shared, ocp_to_fnuz
from hip_kernels.library import op
from hip_kernels.platform import default_device

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton")
if importlib.util.find_spec("triton") is not None:
    from triton_interp_shim import interpreter_shim  # noqa: F401 (autouse: bf16 rounds as GPUs)

DEV = default_device()   # the GPU where there is one (Triton compiled), else the CPU (interpreted)
N_EXPERTS, K, DIM, INTER, SHARED_INTER, LIMIT = 4, 2, 128, 128, 256, 7.0


@pytest.fixture(autouse=True)
def wide_column_blocks(monkeypatch):
    """64 output columns a program (the launch's 16): a quarter of the programs, and the
    interpreter's time is per program; the column blocks and the FP8 scale rows still vary."""
    from hip_kernels import moe_fused_quant_triton
    monkeypatch.setattr(moe_fused_quant_triton, "BLOCK_N", 64)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def fp4_experts(seed):
    """Random e2m1 bytes and ue8m0 scales 2^-5 .. 2^-2 (the clamp at LIMIT is reached)."""
    g, out = gen(seed), {}
    for name, (n, k) in (("w1", (INTER, DIM)), ("w3", (INTER, DIM)), ("w2", (DIM, INTER))):
        out[name] = torch.randint(-128, 128, (N_EXPERTS, n, k // 2), generator=g,
                                  dtype=torch.int8).to(DEV)
        out[name + "_scale"] = torch.randint(122, 126, (N_EXPERTS, n, k // 32), generator=g,
                                             dtype=torch.uint8).view(torch.float8_e8m0fnu).to(DEV)
    return out


def fp8_expert(seed, fnuz=False):
    """e4m3fn weights with one random ue8m0 scale 2^-6 .. 2^-3 per 128x128 block (fnuz:
    `ocp_to_fnuz`'s)."""
    g, out = gen(seed), {}
    for name, (n, k) in (("w1", (SHARED_INTER, DIM)), ("w3", (SHARED_INTER, DIM)),
                         ("w2", (DIM, SHARED_INTER))):
        w = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn)
        s = torch.randint(121, 125, (n // 128, k // 128), generator=g,
                          dtype=torch.uint8).view(torch.float8_e8m0fnu)
        out[name], out[name + "_scale"] = ocp_to_fnuz(w, s) if fnuz else (w, s)
    return {k: v.to(DEV) for k, v in out.items()}


def routing(n, seed):
    g = gen(seed)
    x = torch.randn(n, DIM, generator=g).bfloat16()
    indices = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:K] for _ in range(n)])
    return x.to(DEV), torch.rand(n, K, generator=g).to(DEV), indices.to(DEV)


def routed_op(x, weights, indices, w, limit, dialect, backend):
    return op("moe_routed", backend)(x, weights, indices, w["w1"], w["w3"], w["w2"],
                                     w["w1_scale"], w["w3_scale"], w["w2_scale"], limit, dialect)


def assert_near(got, want):
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                               atol=2e-2 * want.abs().max().item())


TRITON = KernelOptions(backend="triton")


@pytest.fixture
def fused_calls(monkeypatch):
    """The fused quantized launchers the ops call, by name, in order."""
    from hip_kernels import moe_fused_quant_triton
    calls = []
    for name in ("moe_routed_fp4_triton", "moe_shared_fp8_triton"):
        def spy(*args, real=getattr(moe_fused_quant_triton, name), name=name):
            calls.append(name)
            return real(*args)
        monkeypatch.setattr(moe_fused_quant_triton, name, spy)
    return calls


def test_fp4_routed_matches_the_reference(fused_calls):
    """Through the public op (the fused kernels when the options ask for Triton; on a CPU the
    torch reference by default), two tokens, the clamp at LIMIT reached."""
    w = fp4_experts(seed=1)
    x, weights, indices = routing(2, seed=2)
    got = moe_routed(x, weights, indices, **w, swiglu_limit=LIMIT, kernel=TRITON)
    assert fused_calls == ["moe_routed_fp4_triton"] and got.dtype == torch.float32
    if DEV.type == "cpu":
        want = moe_routed(x, weights, indices, **w, swiglu_limit=LIMIT)
        assert fused_calls == ["moe_routed_fp4_triton"]
    else:
        want = routed_op(x, weights, indices, w, LIMIT, "ocp", "torch")
    assert_near(got, want)


def test_fp4_routed_fnuz_activations_without_clamp():
    """fnuz (MI300): the activations rounded on the half grid, then doubled (the same values);
    limit 0: no clamp."""
    w = fp4_experts(seed=3)
    x, weights, indices = routing(1, seed=4)
    assert_near(routed_op(x, weights, indices, w, 0.0, "fnuz", "triton"),
                routed_op(x, weights, indices, w, 0.0, "fnuz", "torch"))


def test_fp4_routed_never_reads_an_unrouted_expert():
    """NaN scales (byte 0xFF) in an expert no token chose leave the output the clean one."""
    w = fp4_experts(seed=5)
    x, weights, indices = routing(1, seed=6)
    want = routed_op(x, weights, indices, w, LIMIT, "ocp", "torch")
    unused = sorted(set(range(N_EXPERTS)) - set(indices.flatten().tolist()))[0]
    for name in ("w1_scale", "w3_scale", "w2_scale"):
        w[name].view(torch.uint8)[unused] = 0xFF
    assert_near(routed_op(x, weights, indices, w, LIMIT, "ocp", "triton"), want)


@pytest.mark.parametrize("fnuz", [False, True])
def test_fp8_shared_matches_the_reference(fnuz, fused_calls):
    """inter 256: two 128-row scale blocks for w1 / w3, two K blocks for w2. OCP weights through
    the public op (Triton when asked); fnuz: the weights `ocp_to_fnuz` converted, the
    activations stored halved with a doubled scale."""
    s = fp8_expert(seed=7, fnuz=fnuz)
    x, _, _ = routing(2, seed=8)
    routed = (torch.randn(2, DIM, generator=gen(9)) / 4).to(DEV)   # the expert's part dominates
    args = (routed, x, s["w1"], s["w3"], s["w2"], s["w1_scale"], s["w3_scale"], s["w2_scale"],
            LIMIT)
    want = op("moe_shared", "torch")(*args)
    if fnuz:
        got = op("moe_shared", "triton")(*args)
    else:
        got = moe_shared(routed, x, **s, swiglu_limit=LIMIT, kernel=TRITON)
        assert fused_calls == ["moe_shared_fp8_triton"]
    assert got.dtype == torch.bfloat16
    assert_near(got, want)


def test_bad_quantized_weights_raise_naming_them():
    x, weights, indices = routing(1, seed=11)
    w = fp4_experts(seed=12)
    with pytest.raises(ValueError, match="w2 must have shape"):
        moe_routed(x, weights, indices, **{**w, "w2": w["w2"][:, :, :-1]})
    with pytest.raises(ValueError, match="w3_scale must have shape"):
        moe_routed(x, weights, indices, **{**w, "w3_scale": w["w3_scale"][:, :, :-1]})
    with pytest.raises(TypeError, match="w1 must have dtype"):
        moe_routed(x, weights, indices, **{**w, "w1": w["w1"].float()})
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_routed(x[:, :64], weights, indices, **w)
    s = fp8_expert(seed=13)
    with pytest.raises(ValueError, match="w2_scale must have shape"):
        moe_shared(torch.zeros(1, DIM), x, **{**s, "w2_scale": s["w2_scale"][:, :1]})
    with pytest.raises(TypeError, match="w1_scale, w3_scale, w2_scale must have one dtype"):
        moe_shared(torch.zeros(1, DIM), x, **{**s, "w1_scale": s["w1_scale"].float()})
