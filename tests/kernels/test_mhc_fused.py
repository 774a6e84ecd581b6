"""mHC pre (+ the block's RMSNorm), mHC post and the mHC head (+ the final RMSNorm) as one
dispatcher op each: the torch references are the model's pre-fusion chain bit for bit, the Triton
kernels (under the interpreter) match them to a stated tolerance, one op per call, argument
checks."""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import mhc_fused, mhc_split  # noqa: E402
from hip_kernels.library import op  # noqa: E402
from hip_kernels.rms_norm import rms_norm_ref  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from op_recorder import op_names  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

DEV = default_device()   # the GPU where there is one (Triton compiled), else the CPU (interpreted)
HC, ITERS, EPS, NORM_EPS = 4, 20, 1e-6, 1e-6


def inputs(n, d, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    width = (2 + HC) * HC
    x = torch.randn(n, HC, d, generator=g).to(dtype)
    fn = torch.randn(width, HC * d, generator=g) / (HC * d) ** 0.5
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(width, generator=g)
    weight = torch.rand(d, generator=g) + 0.5
    return [t.to(DEV) for t in (x, fn, scale, base, weight)]


def pre_fusion_chain(x, fn, scale, base, weight, reference):
    """What the model ran before the fusion: mixes, hc_split, weighted sum, RMSNorm."""
    xf = x.flatten(-2).float()
    mixes = torch.nn.functional.linear(xf, fn) * torch.rsqrt(
        xf.square().mean(-1, keepdim=True) + EPS)
    pre, post, comb = mhc_split.hc_split_ref(mixes, scale, base, HC, ITERS, EPS, reference)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
    if weight is None:
        return y, post, comb
    yf = y.float()
    return ((weight * (yf * torch.rsqrt(yf.square().mean(-1, keepdim=True) + NORM_EPS)))
            .to(x.dtype), post, comb)


def call_pre(x, fn, scale, base, weight, backend, reference=True):
    return op("hc_pre", backend)(x, fn, scale, base, weight, EPS, ITERS, EPS, NORM_EPS,
                                 reference)


@pytest.mark.parametrize("reference", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_the_reference_is_the_pre_fusion_chain_bit_for_bit(reference, norm):
    x, fn, scale, base, weight = inputs(5, 64, seed=1)
    weight = weight if norm else None
    got = call_pre(x, fn, scale, base, weight, "torch", reference)
    for g, w in zip(got, pre_fusion_chain(x, fn, scale, base, weight, reference)):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("n,d", [(1, 64), (3, 96), (8, 256)])
@pytest.mark.parametrize("norm", [True, False])
def test_triton_hc_pre_matches_the_reference(n, d, norm):
    """fp32 in the same order with the same roundings, sums in Triton's order: post and comb to
    ~1e-5 relative; y (bf16) to one bf16 ulp where a sum lands near a rounding boundary."""
    x, fn, scale, base, weight = inputs(n, d, seed=n + d)
    weight = weight if norm else None
    want = call_pre(x, fn, scale, base, weight, "torch")
    got = call_pre(x, fn, scale, base, weight, "triton")
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_hc_post_matches_the_reference(dtype):
    """Each output is one fp32 sum of hc + 1 products, rounded once to out's dtype; the
    interpreter sums in the reference's order here (fp32 to 1e-6, bf16 exact)."""
    g = torch.Generator().manual_seed(5)
    n, d = 3, 300
    out = torch.randn(n, d, generator=g).to(dtype).to(DEV)
    res = torch.randn(n, HC, d, generator=g).to(dtype).to(DEV)
    post = torch.rand(n, HC, generator=g).to(DEV) * 2
    comb = torch.rand(n, HC, HC, generator=g).to(DEV)
    want = op("hc_post", "torch")(out, res, post, comb)
    got = op("hc_post", "triton")(out, res, post, comb)
    assert got.dtype == dtype and got.shape == (n, HC, d)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32
                               else 2 ** -8, atol=1e-6)


def head_inputs(n, d, seed=0, dtype=torch.bfloat16):
    """The head's weights: fn [hc, hc d], scale [1], base [hc] (fp32, as the model holds them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HC, d, generator=g).to(dtype)
    fn = torch.randn(HC, HC * d, generator=g) / (HC * d) ** 0.5
    scale = torch.rand(1, generator=g) + 0.5
    base = torch.randn(HC, generator=g)
    weight = torch.rand(d, generator=g) + 0.5
    return [t.to(DEV) for t in (x, fn, scale, base, weight)]


def head_chain(x, fn, scale, base, weight):
    """What the model ran before the head was one op: hc_mixes, sigmoid, the weighted sum, then
    the final norm (`rms_norm`'s torch body)."""
    pre = torch.sigmoid(mhc_fused.hc_mixes(x, fn, EPS) * scale + base) + EPS
    y = (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
    return y if weight is None else rms_norm_ref(y, weight, NORM_EPS)


def call_head(x, fn, scale, base, weight, backend):
    return op("hc_head", backend)(x, fn, scale, base, weight, EPS, EPS, NORM_EPS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
def test_the_head_reference_is_the_pre_fusion_chain_bit_for_bit(norm, dtype):
    x, fn, scale, base, weight = head_inputs(5, 64, seed=2, dtype=dtype)
    weight = weight if norm else None
    got = call_head(x, fn, scale, base, weight, "torch")
    want = head_chain(x, fn, scale, base, weight)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("d", [64, 256, 4096])     # tiny, small, Flash
@pytest.mark.parametrize("norm", [True, False])
def test_triton_hc_head_matches_the_reference(n, d, norm):
    """fp32 in the reference's order with its roundings, but the mixes' hc * d long dot summed
    in Triton's block order (the reference's is a GEMM's): a pre weight may move by an fp32 ulp,
    so an output next to a bf16 rounding boundary may round the other way (one bf16 step; more
    steps, but ~1e-7 apart, for a sum that cancels to near zero). Measured here: equal bit for
    bit at d 64 and 256 with these seeds, a few values in 10^4 apart at d 4096."""
    x, fn, scale, base, weight = head_inputs(n, d, seed=n * 1000 + d)
    weight = weight if norm else None
    want = call_head(x, fn, scale, base, weight, "torch")
    got = call_head(x, fn, scale, base, weight, "triton")
    assert got.dtype == torch.bfloat16 and got.shape == (n, d)
    assert (got != want).count_nonzero() <= max(1, got.numel() // 1000)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)


def test_triton_hc_head_fp32():
    x, fn, scale, base, weight = head_inputs(3, 96, seed=4, dtype=torch.float32)
    want = call_head(x, fn, scale, base, weight, "torch")
    got = call_head(x, fn, scale, base, weight, "triton")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_one_dispatcher_op_per_call():
    x, fn, scale, base, weight = inputs(2, 64)
    pre = op_names(lambda: mhc_fused.hc_pre(x, fn, scale, base, weight, mix_eps=EPS,
                                            iters=ITERS, hc_eps=EPS, norm_eps=NORM_EPS))
    assert pre == ["dsv4::hc_pre"]
    out, post, comb = (torch.rand(s, device=DEV) for s in ((2, 64), (2, HC), (2, HC, HC)))
    assert op_names(lambda: mhc_fused.hc_post(out, x, post, comb)) == ["dsv4::hc_post"]
    hx, hfn, hscale, hbase, hweight = head_inputs(2, 64)
    assert op_names(lambda: mhc_fused.hc_head(hx, hfn, hscale, hbase, hweight, mix_eps=EPS,
                                              hc_eps=EPS, norm_eps=NORM_EPS)) == ["dsv4::hc_head"]


def test_bad_arguments_raise_naming_them():
    x, fn, scale, base, weight = inputs(2, 64)
    kw = dict(mix_eps=EPS, iters=ITERS, hc_eps=EPS, norm_eps=NORM_EPS)
    with pytest.raises(ValueError, match="fn must have shape"):
        mhc_fused.hc_pre(x, fn[:, :-1], scale, base, weight, **kw)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        mhc_fused.hc_pre(x, fn, scale, base, weight[:-1], **kw)
    with pytest.raises(ValueError, match="iters must be an int >= 1"):
        mhc_fused.hc_pre(x, fn, scale, base, weight, **{**kw, "iters": 0})
    with pytest.raises(TypeError, match="x must have dtype"):
        mhc_fused.hc_pre(x.int(), fn, scale, base, weight, **kw)
    with pytest.raises(TypeError, match="norm_eps"):   # the norm's eps is the caller's to state
        mhc_fused.hc_pre(x, fn, scale, base, weight, mix_eps=EPS, iters=ITERS, hc_eps=EPS)
    post, comb = torch.rand(2, HC, device=DEV), torch.rand(2, HC, HC, device=DEV)
    with pytest.raises(ValueError, match="comb must have shape"):
        mhc_fused.hc_post(x[:, 0], x, post, comb[:, :2])
    with pytest.raises(TypeError, match="post must have dtype"):
        mhc_fused.hc_post(x[:, 0], x, post.double(), comb)


def test_bad_head_arguments_raise_naming_them():
    x, fn, scale, base, weight = head_inputs(2, 64)
    kw = dict(mix_eps=EPS, hc_eps=EPS, norm_eps=NORM_EPS)
    with pytest.raises(ValueError, match="fn must have shape"):
        mhc_fused.hc_head(x, fn[:, :-1], scale, base, weight, **kw)
    with pytest.raises(ValueError, match="scale must have shape"):
        mhc_fused.hc_head(x, fn, torch.ones(3, device=DEV), base, weight, **kw)
    with pytest.raises(ValueError, match="base must have shape"):
        mhc_fused.hc_head(x, fn, scale, base[:-1], weight, **kw)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        mhc_fused.hc_head(x, fn, scale, base, weight[:-1], **kw)
    with pytest.raises(TypeError, match="x must have dtype"):
        mhc_fused.hc_head(x.int(), fn, scale, base, weight, **kw)
    with pytest.raises(ValueError, match="x must be 3-D"):
        mhc_fused.hc_head(x[0], fn, scale, base, weight, **kw)
    with pytest.raises(TypeError, match="norm_eps"):   # the norm's eps is the caller's to state
        mhc_fused.hc_head(x, fn, scale, base, weight, mix_eps=EPS, hc_eps=EPS)
