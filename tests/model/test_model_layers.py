"""The building blocks of dsv4.layers against first principles and the dense reference's pieces."""

import math

import pytest
import torch

import dense_reference as ref
from dsv4.config import ModelConfig
from dsv4.options import Options
from dsv4.layers import mhc
from dsv4.layers.attention import Attention
from dsv4.layers.compressor import Compressor
from dsv4.layers.moe import MoE
from hip_kernels.activation_sim import fp4_quant_dequant, hadamard_rotate, round_to_e2m1
from dsv4.layers.rope import (apply_rotary_emb, find_correction_range, layer_freqs_cis,
                              rope_frequencies)
from hip_kernels import capture

OPTIONS = Options()
TINY = ModelConfig.preset("tiny")


def test_yarn_correction_range_and_ramp_on_the_published_values():
    # compress_rope_theta 160000, original 65536, beta 32/1, 64 rope dims -> dims [15, 25]
    assert find_correction_range(32, 1, 64, 160000, 65536) == (15, 25)
    base = rope_frequencies(64, 160000)
    yarn = rope_frequencies(64, 160000, 65536, 16, 32, 1)
    assert torch.equal(yarn[:15], base[:15])                       # fast dims untouched
    torch.testing.assert_close(yarn[25:], base[25:] / 16, rtol=1e-6, atol=0)  # slow dims / factor
    mid = 1 - (20 - 15) / 10                                        # half way up the ramp
    torch.testing.assert_close(yarn[20], base[20] / 16 * (1 - mid) + base[20] * mid)
    assert torch.equal(yarn, ref.rope_inv_freq(ModelConfig.preset("flash"), 4))


def test_ratio0_layers_use_plain_rope_theta():
    f0 = layer_freqs_cis(TINY, 0, 10)
    f4 = layer_freqs_cis(TINY, 4, 10)
    assert torch.allclose(f0[1].angle(), rope_frequencies(64, 10000.0))
    assert torch.allclose(f4[1].angle(), ref.rope_inv_freq(TINY, 4))
    assert torch.equal(layer_freqs_cis(TINY, 128, 10), f4)


def test_rope_is_interleaved_relative_and_inverted_by_the_conjugate():
    f = layer_freqs_cis(TINY, 4, 600)
    x = torch.zeros(1, 64)
    x[0, 0] = 1.0                                   # pair (x0, x1) = (1, 0) -> (cos, sin)
    y = apply_rotary_emb(x, f[7:8])
    assert torch.allclose(y[0, :2], torch.stack([f[7, 0].real, f[7, 0].imag]))
    assert not y[0, 2:].any()
    q, k = torch.randn(2, 1, 64).unbind(0)
    dots = [(apply_rotary_emb(q, f[p:p + 1]) * apply_rotary_emb(k, f[p - 5:p - 4])).sum()
            for p in (5, 100, 517)]
    assert torch.allclose(torch.stack(dots), dots[0].expand(3), atol=1e-4)
    z = torch.randn(3, 4, 64)
    back = apply_rotary_emb(apply_rotary_emb(z, f[:3]), f[:3], inverse=True)
    torch.testing.assert_close(back, z, atol=1e-5, rtol=1e-5)
    ours = apply_rotary_emb(z, f[10:13])
    theirs = ref.rope_last(z, torch.arange(10, 13), ref.rope_inv_freq(TINY, 4))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_sinkhorn_gives_a_doubly_stochastic_comb():
    hc = 4
    mixes = torch.randn(5, (2 + hc) * hc)
    pre, post, comb = mhc.hc_split(mixes, torch.tensor([1.0, 1.0, 1.0]), torch.zeros(24), hc, 20,
                                   1e-6, reference=True, kernel=OPTIONS.kernel)
    assert (comb > 0).all() and (pre > 0).all() and ((post > 0) & (post < 2)).all()
    # 20 iterations end on a column step: columns sum to 1, rows nearly (Sinkhorn converges)
    torch.testing.assert_close(comb.sum(-1), torch.ones(5, hc), atol=1e-2, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, hc), atol=1e-5, rtol=0)


def test_hc_pre_post_match_the_dense_restatement():
    x = torch.randn(6, 4, 64).to(torch.bfloat16)
    fn, base, scale = torch.randn(24, 256) / 16, torch.randn(24), torch.rand(3)
    y, post, comb = mhc.hc_pre(x, fn, scale, base, 1e-6, 20, 1e-6, reference=True,
                               kernel=OPTIONS.kernel)
    pre_r, post_r, comb_r = ref.hc_weights(x, fn, scale, base, TINY)
    torch.testing.assert_close(y, ref.hc_combine(x, pre_r))
    torch.testing.assert_close(comb, comb_r)
    out = torch.randn(6, 64).to(torch.bfloat16)
    torch.testing.assert_close(mhc.hc_post(out, x, post, comb),
                               ref.hc_expand(out, x, post_r, comb_r))


def test_e2m1_rounding_is_nearest_even_on_the_grid():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 0.3, -2.6, 6.0, -0.25])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5, -3.0, 6.0, -0.0])
    assert torch.equal(round_to_e2m1(y), want)


def test_fp4_simulation_matches_the_dense_restatement_and_is_idempotent():
    x = (torch.randn(64, 128) * torch.logspace(-3, 3, 64).unsqueeze(1)).to(torch.bfloat16)
    q = fp4_quant_dequant(x)
    assert torch.equal(q, ref.fp4_sim(x))
    assert torch.equal(fp4_quant_dequant(q), q)
    blocks = q.float().view(-1, 32)
    scale = 2.0 ** torch.ceil(torch.log2(x.float().view(-1, 32).abs().amax(-1, keepdim=True) / 6))
    assert torch.isin((blocks / scale).abs(), ref.E2M1_GRID).all()


@pytest.mark.parametrize("reference", [True, False], ids=["reference", "fp32"])
def test_hadamard_is_orthonormal_and_matches_the_dense_restatement(reference):
    x = torch.randn(10, 128)
    torch.testing.assert_close(hadamard_rotate(hadamard_rotate(x, reference), reference), x,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hadamard_rotate(x, reference), ref.hadamard(x))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.randn(2, 96), reference)


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_pool_matches_a_per_channel_loop(ratio):
    torch.manual_seed(0)
    c = Compressor(64, 512, 64, ratio, 1e-6)
    rows = c.window_rows
    kv, score = torch.randn(2, 3, rows, c.coff * 512).unbind(0)
    has_prev = torch.tensor([True, False, True])
    if ratio == 4:
        kv[1, :ratio] = float("nan")                # a missing previous window is never read
    out = c.pool(kv, score, has_prev)
    for m in range(3):
        if ratio == 4:
            lo = 0 if has_prev[m] else ratio
            k = torch.cat([kv[m, lo:ratio, :512], kv[m, ratio:, 512:]])
            s = torch.cat([score[m, lo:ratio, :512], score[m, ratio:, 512:]])
        else:
            k, s = kv[m], score[m]
        torch.testing.assert_close(out[m], (k * s.softmax(0)).sum(0))


@pytest.mark.parametrize("mode", ["fp32", "reference"])
def test_attention_sink_only_enters_the_denominator(mode):
    """fp32: the plain softmax with the sink's exp added to the denominator. reference (one
    64-row block here): the numerator's probabilities exp(s - m) rounded to bf16, m the max
    without the sink, the denominator their fp32 sum plus exp(sink - m)."""
    reference = mode == "reference"
    torch.manual_seed(0)
    attn = Attention(TINY, 0, dtype=torch.float32)
    q, kv = torch.randn(2, 4, 512), torch.randn(2, 5, 512)
    valid = torch.tensor([[True] * 5, [True, True, False, False, False]])
    with torch.no_grad():
        attn.attn_sink.fill_(float("-inf"))
        plain = attn.sparse_attention(q, [kv[:, :2], kv[:, 2:]], [valid[:, :2], valid[:, 2:]],
                                      reference)
        attn.attn_sink.copy_(torch.tensor([0.0, 1.0, 2.0, 3.0]))
        sunk = attn.sparse_attention(q, [kv], [valid], reference)
    s = torch.einsum("nhd,nkd->nhk", q, kv) / math.sqrt(512)
    s = s.masked_fill(~valid[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = (s - m).exp()
    num = p.bfloat16().float() if mode == "reference" else p
    for sink, got in ((None, plain), (attn.attn_sink.detach(), sunk)):
        denom = p.sum(-1, keepdim=True)
        if sink is not None:
            denom = denom + (sink.view(1, -1, 1) - m).exp()
        torch.testing.assert_close(got, torch.einsum("nhk,nkd->nhd", num / denom, kv))


@pytest.mark.parametrize("layer_id", [0, 1])   # hash-routed, score-routed
def test_grouped_moe_matches_the_dense_restatement_and_reads_nothing_on_the_host(layer_id):
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsv4.model import DeepseekV4Model
    from dsv4.random_init import init_random_weights

    class HostReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            HostReads.reads += func.overloadpacket.__name__ == "_local_scalar_dense"
            return func(*args, **(kwargs or {}))

    model = init_random_weights(DeepseekV4Model(TINY), seed=3)
    moe: MoE = model.layers[layer_id].ffn
    x = (torch.randn(7, TINY.dim) * 4).to(torch.bfloat16)      # large enough to hit the clamp
    ids = torch.randint(0, TINY.vocab_size, (7,))
    tolist = torch.Tensor.tolist
    torch.Tensor.tolist = lambda t: pytest.fail("MoE read a tensor to the host")
    try:
        with torch.no_grad(), HostReads():
            eager = moe(x, ids, OPTIONS)
            capture.set_emulated_capture(True)
            try:
                captured = moe(x, ids, OPTIONS)
            finally:
                capture.set_emulated_capture(False)
    finally:
        torch.Tensor.tolist = tolist
    with torch.no_grad():
        want = ref.moe(TINY, model.state_dict(), layer_id, x, ids)
    assert HostReads.reads == 0
    assert torch.equal(eager, captured)
    assert torch.equal(eager, want)
    if layer_id < TINY.n_hash_layers:
        _, idx = moe.gate(x, ids, OPTIONS)
        assert torch.equal(idx, moe.gate.tid2eid[ids])


def test_routed_experts_are_stacked_but_named_per_expert():
    """State dicts name each expert's matrices as checkpoints do; they are views of the stacked
    weights, and load_state_dict takes them back."""
    from dsv4.model import DeepseekV4Model
    from dsv4.random_init import init_random_weights

    model = init_random_weights(DeepseekV4Model(TINY), seed=3)
    sd = model.state_dict()
    experts = model.layers[1].ffn.experts
    assert "layers.1.ffn.experts.w1" not in sd
    for e in (0, TINY.n_routed_experts - 1):
        for name in ("w1", "w2", "w3"):
            view = sd[f"layers.1.ffn.experts.{e}.{name}.weight"]
            assert torch.equal(view, getattr(experts, name)[e])
            assert view.data_ptr() == getattr(experts, name)[e].data_ptr()
    other = DeepseekV4Model(TINY)
    other.load_state_dict({k: v.clone() for k, v in sd.items()})
    assert torch.equal(other.layers[1].ffn.experts.w2, experts.w2)


def test_reference_hadamard_is_the_textbook_butterfly_in_fp32():
    """Reference numerics: the fast Walsh-Hadamard transform's order (half-length h = 1,
    2, 4, ...: y[j], y[j + h] <- y[j] + y[j + h], y[j] - y[j + h], each sum rounded to fp32),
    then times d^-0.5, one rounding to bf16. The fp32 mode's single GEMM differs somewhere
    (72 of these 524,288 values on this CPU)."""
    x = torch.randn(4096, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = [x[:, j].float() for j in range(128)]
    h = 1
    while h < 128:
        for i in range(0, 128, 2 * h):
            for j in range(i, i + h):
                y[j], y[j + h] = y[j] + y[j + h], y[j] - y[j + h]
        h *= 2
    want = (torch.stack(y, 1) * 128 ** -0.5).to(torch.bfloat16)
    got = hadamard_rotate(x, reference=True)
    assert torch.equal(got, want)
    assert not torch.equal(hadamard_rotate(x, reference=False), got)
