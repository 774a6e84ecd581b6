"""The Triton kernels of indexer_query (RoPE + Hadamard + FP4 of the index queries) and
grouped_out_proj (inverse RoPE + grouped wo_a) against their torch references (the model's
chains), under the interpreter on a CPU: indexer_query bit for bit in the reference numerics
and wherever the values before a rounding are equal, grouped_out_proj to one rounding of o's
dtype; which backend the wrappers pick. The RoPE factors are a table's rows at the tokens'
positions (in no order), read by the ops."""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import KernelOptions  # noqa: E402
from hip_kernels.activation_sim import fp4_quant_dequant, hadamard_rotate  # noqa: E402
from hip_kernels.grouped_out_proj import grouped_out_proj, grouped_out_proj_ref  # noqa: E402
from hip_kernels.indexer_query import indexer_query, indexer_query_ref  # noqa: E402
from hip_kernels.kv_layout import pow2_ceil_exponent  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from hip_kernels.rotary import rope_tail  # noqa: E402
from op_recorder import backends  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse: bf16 rounds as GPUs)

DEV = default_device()   # the GPU where there is one (Triton compiled), else the CPU (interpreted)
TRITON = KernelOptions(backend="triton")
ROPE = 64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def freqs(n, seed, angle=6.3):
    return torch.polar(torch.ones(n, ROPE // 2),
                       torch.rand(n, ROPE // 2, generator=gen(seed)) * angle).to(DEV)


def positions(n, rows, seed):
    """n positions, rows of a table of `rows`, in no order (int32: the engine's dtype)."""
    return torch.randint(0, rows, (n,), generator=gen(seed), dtype=torch.int32).to(DEV)


def randn(*shape, seed, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d, heads", [(64, 3), (128, 4)])
def test_indexer_query_gives_the_reference_bits_in_reference_numerics(d, heads, dtype):
    """RoPE (products rounded, then one add), the same butterflies, the FP4 rounding from the
    bits: the same operations in the same order as the reference, so the same bits."""
    n = 3
    q, f = randn(n, heads * d, seed=d, dtype=dtype, scale=2), freqs(n + 9, seed=heads)
    pos = positions(n, n + 9, seed=d)
    got = indexer_query(q, f, pos, heads, ROPE, reference=True, kernel=TRITON)
    assert got.shape == (n, heads, d) and got.dtype == dtype
    want = fp4_quant_dequant(hadamard_rotate(
        rope_tail(q.view(n, heads, d), f[pos.long()], ROPE), True))
    assert torch.equal(indexer_query_ref(q, f, pos, heads, ROPE, True), want)
    assert torch.equal(got, want)


def fp4_block_scale(x):
    """The reference's per-32 block scale of x [..., D], broadcast back to x's shape."""
    amax = x.float().unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    scale = torch.ldexp(torch.ones_like(amax), pow2_ceil_exponent(amax / 6))
    return scale.expand(*amax.shape[:-1], 32).flatten(-2)


def test_indexer_query_fp32_numerics_within_one_fp4_step():
    """fp32 numerics: the reference rotates with one fp32 GEMM, the kernel with the butterflies
    (the same exact product, other roundings), so a value next to the bf16 rounding after it or
    an FP4 tie may round the other way: each value within one step of the coarser neighbouring
    grid (4 x its block's scale: a flipped tie or a doubled block scale), and few of them
    (measured: none, here)."""
    n, heads, d = 3, 4, 128
    q, f = randn(n, heads * d, seed=7, dtype=torch.bfloat16, scale=2), freqs(n + 9, seed=8)
    pos = positions(n, n + 9, seed=9)
    got = indexer_query(q, f, pos, heads, ROPE, reference=False, kernel=TRITON)
    want = indexer_query_ref(q, f, pos, heads, ROPE, False)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= 4 * fp4_block_scale(want)).all())
    assert (diff > 0).float().mean().item() <= 0.01


E2M1_AND_TIES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)


def rotated_values_on_the_grid_and_its_ties(n, heads, d, seed):
    """Values [n, heads, d] that the rotation should produce: per 32-block, e2m1 values and the
    ties between them times 2^e (e in [-4, 4]), the block's amax 6 * 2^e (amax / 6 a power of
    two) or 5 * 2^e (a tie at the top), one block all zeros (the amax floor)."""
    g = gen(seed)
    pick = torch.randint(len(E2M1_AND_TIES), (n, heads, d // 32, 32), generator=g)
    y = torch.tensor(E2M1_AND_TIES)[pick] * (torch.randint(2, pick.shape, generator=g) * 2 - 1)
    y[..., 0] = torch.where(torch.rand(pick.shape[:-1], generator=g) < 0.5, 6.0, -5.0)
    exp = torch.randint(-4, 5, (n, heads, d // 32, 1), generator=g)
    y = y * torch.ldexp(torch.ones(exp.shape), exp)
    y[0, 0, 0] = 0.0
    return y.flatten(-2)


@pytest.mark.parametrize("reference", [True, False])
def test_fp4_rounding_is_exact_at_ties_and_power_of_two_edges(reference):
    """q = H y (H its own inverse, d = 64: scale 1/8, every sum exact in fp32), factors 1 + 0i:
    both numerics' rotations give exactly y, so the kernel's FP4 rounding meets the reference's
    on the same fp32 input, at every e2m1 tie (half to even) and scale edge."""
    n, heads, d = 2, 2, 64
    y = rotated_values_on_the_grid_and_its_ties(n, heads, d, seed=11)
    q = hadamard_rotate(y.double(), False).float().flatten(1).to(DEV)
    f = torch.polar(torch.ones(n, ROPE // 2), torch.zeros(n, ROPE // 2)).to(DEV)
    before_fp4 = hadamard_rotate(rope_tail(q.view(n, heads, d), f, ROPE), reference)
    assert torch.equal(before_fp4, y.to(DEV))
    want = fp4_quant_dequant(before_fp4)
    assert not torch.equal(want, before_fp4)
    got = indexer_query(q, f, torch.arange(n, device=DEV), heads, ROPE, reference=reference,
                        kernel=TRITON)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_grouped_out_proj_within_one_rounding_of_the_reference(d, dtype):
    """The same exact products (bf16 x bf16 is exact in fp32) summed in fp32 in another order,
    one rounding to o's dtype: bf16 within one bf16 ulp (rtol 2^-7; measured: equal here),
    fp32 within the order's rounding (rtol 1e-5; measured: 7e-7 at values near 3)."""
    n, heads, groups, rank = 3, 4, 2, 24      # rank 24: a masked output block
    o, f = randn(n, heads, d, seed=d, dtype=dtype), freqs(n + 9, seed=3)
    pos = positions(n, n + 9, seed=4)
    w = randn(groups * rank, heads * d // groups, seed=5, dtype=dtype, scale=(heads * d) ** -0.5)
    got = grouped_out_proj(o, f, pos, w, groups, ROPE, kernel=TRITON)
    want = grouped_out_proj_ref(o, f, pos, w, groups, ROPE)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_grouped_out_proj_inverse_rope_gives_the_reference_bits():
    """With identity weight blocks the output is the inverse-rotated o itself (each output one
    exact product): the kernel's RoPE roundings are the reference's, bit for bit."""
    n, heads, d, groups = 3, 2, 128, 2
    o, f = randn(n, heads, d, seed=9, dtype=torch.bfloat16, scale=3), freqs(n + 9, seed=10)
    pos = positions(n, n + 9, seed=11)
    eye = torch.eye(heads * d // groups, dtype=torch.bfloat16, device=DEV).repeat(groups, 1)
    got = grouped_out_proj(o, f, pos, eye, groups, ROPE, kernel=TRITON)
    assert torch.equal(got, rope_tail(o, f[pos.long()], ROPE, inverse=True).flatten(1))


def dispatched_backend(call):
    (backend,) = backends(call)
    return backend


def test_the_wrappers_resolve_triton_when_asked_and_torch_on_a_cpu_by_default():
    if DEV.type != "cpu":
        pytest.skip("the CPU backend choice (the interpreter)")
    q, f, pos = randn(2, 2 * 64, seed=1, dtype=torch.bfloat16), freqs(2, seed=2), torch.arange(2)
    assert dispatched_backend(lambda: indexer_query(q, f, pos, 2, ROPE, reference=True,
                                                    kernel=TRITON)) == "triton"
    assert dispatched_backend(lambda: indexer_query(q, f, pos, 2, ROPE,
                                                    reference=True)) == "torch"
    o, w = randn(2, 2, 64, seed=3, dtype=torch.bfloat16), randn(32, 64, seed=4,
                                                              dtype=torch.bfloat16)
    assert dispatched_backend(lambda: grouped_out_proj(o, f, pos, w, 2, ROPE,
                                                       kernel=TRITON)) == "triton"
    assert dispatched_backend(lambda: grouped_out_proj(o, f, pos, w, 2, ROPE)) == "torch"
    # an odd head dim: the kernel's pairs would straddle the RoPE tail; the reference runs it
    odd, w_odd = randn(2, 2, 65, seed=5, dtype=torch.bfloat16), randn(32, 65, seed=6,
                                                                     dtype=torch.bfloat16)
    assert dispatched_backend(lambda: grouped_out_proj(odd, f, pos, w_odd, 2, ROPE,
                                                       kernel=TRITON)) == "torch"
