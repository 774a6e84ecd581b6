"""DSV4_AITER: the policy that sends ops to aiter or keeps the torch path (hip_kernels/aiter_ops).

aiter (AMD's ROCm op library) cannot be installed on a CPU machine, so the CPU tests put a stub
module named ``aiter`` into sys.modules: its ops record their calls and compute the result with
torch, in aiter's calling convention (outputs written into the tensors passed in). The test
marked ``gpu`` compares the real aiter with the torch path on a ROCm GPU.
"""

import logging
import sys
import types

import pytest
import torch

from hip_kernels import KernelOptions, aiter_ops, platform
from hip_kernels.moe_fused import biased_gate


def _make_stub() -> types.ModuleType:
    """Stands for the aiter package (not installable on a CPU): topk_plain and topk_gating with
    aiter's argument order; each call is recorded in ``stub.calls``."""
    stub = types.ModuleType("aiter")
    stub.calls = []

    def topk_plain(x, topk_ids, topk_out, topk, largest=True, rowStarts=None, rowEnds=None,
                   stride0=-1, stride1=1):
        stub.calls.append(("topk_plain", tuple(x.shape), topk))
        assert topk_ids.dtype == torch.int32 and topk_out.dtype == x.dtype
        vals, idx = x.topk(topk, dim=-1, largest=largest)
        # aiter leaves the winners unordered: hand them back reversed, the dispatcher sorts them
        topk_out.copy_(vals.flip(-1))
        topk_ids.copy_(idx.flip(-1).to(torch.int32))

    def topk_gating(topk_weights, topk_indices, gating_output, correction_bias=None,
                    need_renorm=True, routed_scaling_factor=1.0, score_func="sqrtsoftplus"):
        """aiter's documented semantics, computed in float64 and handed back in another expert
        order (reversed), as a kernel may."""
        stub.calls.append(("topk_gating", score_func, need_renorm, routed_scaling_factor))
        assert topk_weights.dtype == torch.float32 and topk_indices.dtype == torch.int32
        x = gating_output.double()
        scores = {"softmax": x.softmax(-1), "sigmoid": x.sigmoid(),
                  "sqrtsoftplus": torch.nn.functional.softplus(x).sqrt()}[score_func]
        k = topk_weights.shape[1]
        idx = (scores + correction_bias.double()).topk(k, dim=-1).indices
        w = scores.gather(1, idx)
        if need_renorm:
            w = w / w.sum(-1, keepdim=True)
        topk_weights.copy_((w * routed_scaling_factor).flip(-1))
        topk_indices.copy_(idx.flip(-1).to(torch.int32))

    stub.topk_plain = topk_plain
    stub.topk_gating = topk_gating
    return stub


@pytest.fixture
def aiter_env(flag_env, monkeypatch):
    """flag_env, plus a fresh probe; yields a function installing the stub (or hiding aiter)."""
    aiter_ops.probe.cache_clear()

    def install(stub=True):
        if stub:
            mod = _make_stub()
            monkeypatch.setitem(sys.modules, "aiter", mod)
            return mod
        monkeypatch.setitem(sys.modules, "aiter", None)  # `import aiter` raises ImportError
        return None

    yield flag_env, install
    aiter_ops.probe.cache_clear()


def policy(kw: dict) -> dict:
    """use_aiter's keyword arguments for the op keywords kw (numerics, kernel)."""
    return dict(aiter=kw["kernel"].aiter, numerics=kw["numerics"])


def _rocm(monkeypatch):
    """Let the auto policy believe the process runs on ROCm (the tensors stay on the CPU)."""
    monkeypatch.setattr(platform, "backend", lambda: "rocm")


def _scores(n=3, t=40, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, t, generator=g).to(dtype)


def test_flag_declared_with_choices(flag_env):
    from hip_kernels import envs
    flag_env()
    assert envs.AITER.get() == "auto"
    assert envs.AITER.choices == ("auto", "0", "1")
    flag_env(DSV4_AITER="1")
    assert envs.AITER.get() == "1"


def test_off_never_calls_aiter(aiter_env, monkeypatch):
    flag_env, install = aiter_env
    stub = install()
    _rocm(monkeypatch)
    kw = dict(numerics="fp32", kernel=KernelOptions(aiter="0"))
    s = _scores()
    vals, idx = aiter_ops.topk_rows(s, 5, **kw)
    assert stub.calls == []
    assert aiter_ops.probe.cache_info().currsize == 0  # not even imported
    ref = s.topk(5, dim=-1)
    assert torch.equal(vals, ref.values) and torch.equal(idx, ref.indices)


def test_on_calls_aiter_and_sorts_like_torch(aiter_env):
    flag_env, install = aiter_env
    stub = install()
    # 1 ignores the device and numerics conditions
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    g = torch.Generator().manual_seed(1)
    s = torch.stack([torch.randperm(40, generator=g) for _ in range(3)]).to(torch.bfloat16)
    vals, idx = aiter_ops.topk_rows(s, 7, **kw)  # distinct values: no ties to order
    assert stub.calls == [("topk_plain", (3, 40), 7)]
    ref = s.topk(7, dim=-1)
    assert torch.equal(vals, ref.values) and torch.equal(idx, ref.indices)
    assert idx.dtype == torch.int64 and vals.dtype == torch.bfloat16


def test_on_keeps_torch_outside_the_kernel_limits(aiter_env):
    flag_env, install = aiter_env
    stub = install()
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    s = _scores(n=2, t=3000)
    for x, k in ((s, 0), (s, aiter_ops.TOPK_MAX_K + 1), (s.double(), 4), (s[:0], 4)):
        vals, idx = aiter_ops.topk_rows(x, k, **kw)
        ref = x.topk(k, dim=-1)
        assert torch.equal(vals, ref.values) and torch.equal(idx, ref.indices)
    assert stub.calls == []


def test_auto_on_cpu_tensor_falls_back(aiter_env, monkeypatch):
    flag_env, install = aiter_env
    stub = install()
    _rocm(monkeypatch)
    kw = dict(numerics="fp32", kernel=KernelOptions(aiter="auto"))
    aiter_ops.topk_rows(_scores(), 4, **kw)
    assert stub.calls == []


def test_auto_on_cpu_backend_falls_back_without_importing(aiter_env):
    flag_env, install = aiter_env
    stub = install()
    kw = dict(numerics="fp32", kernel=KernelOptions(aiter="auto"))  # DSV4_AITER unset = auto
    if platform.backend() != "cpu":
        pytest.skip("checks a CPU-only process")
    aiter_ops.topk_rows(_scores(), 4, **kw)
    assert stub.calls == [] and aiter_ops.probe.cache_info().currsize == 0


def test_auto_with_reference_numerics_falls_back(aiter_env, monkeypatch):
    flag_env, install = aiter_env
    stub = install()
    _rocm(monkeypatch)
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="auto"))  # the defaults
    assert not aiter_ops.use_aiter("topk_rows", torch.empty(1, device="meta"), **policy(kw))
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="auto"))
    aiter_ops.topk_rows(_scores(), 4, **kw)
    assert stub.calls == []


def test_auto_uses_aiter_for_gpu_tensors_in_fp32(aiter_env, monkeypatch):
    """The one case auto sends to aiter; a tensor's device is faked (no GPU here), so only the
    decision is checked."""
    flag_env, install = aiter_env
    install()
    _rocm(monkeypatch)
    kw = dict(numerics="fp32", kernel=KernelOptions(aiter="auto"))
    fake_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert aiter_ops.use_aiter("topk_rows", fake_gpu, **policy(kw))
    assert not aiter_ops.use_aiter("topk_rows", torch.empty(1), **policy(kw))


def test_on_without_aiter_raises_naming_the_flag(aiter_env):
    flag_env, install = aiter_env
    install(stub=False)
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    with pytest.raises(aiter_ops.AiterUnavailableError, match="DSV4_AITER"):
        aiter_ops.topk_rows(_scores(), 4, **kw)


def test_on_with_an_aiter_lacking_the_op_falls_back(aiter_env):
    flag_env, install = aiter_env
    stub = install()
    del stub.topk_plain
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    s = _scores()
    vals, idx = aiter_ops.topk_rows(s, 4, **kw)
    assert torch.equal(idx, s.topk(4, dim=-1).indices)
    assert not aiter_ops.probe().has("topk_rows") and aiter_ops.probe().has("moe_gate")


def test_an_older_topk_plain_without_the_values_output_counts_as_missing(aiter_env):
    """Older aiter releases had topk_plain(x, topk_ids, topk, largest): calling it with this
    module's arguments would fail, so the probe must not dispatch to it."""
    flag_env, install = aiter_env
    stub = install()

    def old_topk_plain(x, topk_ids, topk, largest):
        raise AssertionError("the old signature must not be called")

    stub.topk_plain = old_topk_plain
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    s = _scores()
    _, idx = aiter_ops.topk_rows(s, 4, **kw)
    assert torch.equal(idx, s.topk(4, dim=-1).indices)
    assert not aiter_ops.probe().has("topk_rows")


def test_probe_logs_one_line_listing_the_ops(aiter_env, caplog):
    flag_env, install = aiter_env
    install()
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    with caplog.at_level(logging.INFO, logger="hip_kernels.aiter_ops"):
        for _ in range(3):
            aiter_ops.topk_rows(_scores(), 4, **kw)
        found = aiter_ops.probe()
    lines = [r for r in caplog.records if r.name == "hip_kernels.aiter_ops"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    msg = lines[0].getMessage()
    assert "\n" not in msg
    assert "topk_rows (aiter.topk_plain)" in msg and "moe_gate (aiter.topk_gating" in msg
    assert found.importable and found.available == frozenset({"topk_rows", "moe_gate"})


def test_probe_line_when_aiter_is_missing(aiter_env, caplog):
    flag_env, install = aiter_env
    install(stub=False)
    with caplog.at_level(logging.INFO, logger="hip_kernels.aiter_ops"):
        found = aiter_ops.probe()
        aiter_ops.probe()
    lines = [r.getMessage() for r in caplog.records if r.name == "hip_kernels.aiter_ops"]
    assert len(lines) == 1 and "not importable" in lines[0] and "topk_rows" in lines[0]
    assert not found.importable and "ModuleNotFoundError" in found.error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [0, 1, 5, 40])
def test_fallback_is_torch_topk(aiter_env, dtype, k):
    flag_env, install = aiter_env
    install(stub=False)
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="auto"))
    s = _scores(n=4, t=40, seed=k, dtype=dtype)
    s[1, ::3] = float("-inf")
    s[2, :] = s[2, 0]  # every entry tied
    vals, idx = aiter_ops.topk_rows(s, k, **kw)
    ref = s.topk(k, dim=-1)
    assert torch.equal(vals, ref.values) and torch.equal(idx, ref.indices)


@pytest.mark.parametrize("scores,k,name", [
    (torch.zeros(3), 1, "scores"), (torch.zeros(2, 3, 4), 1, "scores"), ([[1.0]], 1, "scores"),
    (torch.zeros(2, 3), 4, "k"), (torch.zeros(2, 3), -1, "k"), (torch.zeros(2, 3), 1.0, "k"),
])
def test_bad_input_names_the_argument(flag_env, scores, k, name):
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="0"))
    with pytest.raises(ValueError, match=name):
        aiter_ops.topk_rows(scores, k, **kw)


def test_unknown_op_names_the_argument(flag_env):
    with pytest.raises(ValueError, match="op="):
        aiter_ops.use_aiter("fused_moe", torch.zeros(1), aiter="auto", numerics="fp32")


@pytest.mark.parametrize("bad, match", [
    (dict(aiter="on", numerics="fp32"), r"aiter='on': expected one of auto\|0\|1"),
    (dict(aiter="auto", numerics="bf16"), r"numerics='bf16': expected one of reference\|fp32"),
])
def test_a_bad_policy_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        aiter_ops.use_aiter("topk_rows", torch.zeros(1), **bad)
    with pytest.raises(TypeError, match="kernel must be a hip_kernels.KernelOptions"):
        aiter_ops.topk_rows(_scores(), 4, kernel="1")


def test_indexer_select_dispatches(aiter_env):
    """Indexer.select goes through topk_rows: with the options' aiter="1" the stub runs it, and
    the result is the torch path's, -1 where fewer rows are visible than k."""
    from dsv4.layers.indexer import Indexer
    from dsv4.options import Options
    _, install = aiter_env
    stub = install()
    ix = types.SimpleNamespace(topk=4, sum_scores_over_ranks=lambda scores: scores)  # one rank
    s = _scores(n=3, t=6)
    visible = torch.ones(3, 6, dtype=torch.bool)
    visible[1, 2:] = False
    ref = Indexer.select(ix, s, visible, Options(kernel=KernelOptions(aiter="0")))
    assert stub.calls == [] and (ref[1, 2:] == -1).all()
    assert torch.equal(Indexer.select(ix, s, visible, Options(kernel=KernelOptions(aiter="1"))),
                       ref)
    assert [c[0] for c in stub.calls] == ["topk_plain"]


def _real_aiter_on_rocm():
    if platform.backend() != "rocm":
        return "needs a ROCm GPU"
    try:
        import aiter  # noqa: F401
    except Exception as e:  # not installed, or its import fails
        return f"aiter is not importable: {type(e).__name__}: {e}"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,t,k", [(1, 64, 1), (4, 1000, 64), (8, 8192, 512), (2, 70000, 2048),
                                   (3, 512, 512)])
def test_aiter_ops_match_torch_on_rocm(flag_env, dtype, n, t, k):
    """Each aiter op against the torch path: the same values, and (distinct scores, so no ties)
    the same indices; masked rows (-inf) as the indexer passes them."""
    reason = _real_aiter_on_rocm()
    if reason:
        pytest.skip(reason)
    aiter_ops.probe.cache_clear()
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    assert aiter_ops.probe().has("topk_rows")
    if dtype == torch.bfloat16:  # integers up to 256 are exact in bf16: keep the rows distinct
        t, k = min(t, 256), min(k, t, 256)
    g = torch.Generator(device="cuda").manual_seed(n * t + k)
    s = torch.stack([torch.randperm(t, generator=g, device="cuda") for _ in range(n)]).to(dtype)
    s[0, ::5] = float("-inf")
    vals, idx = aiter_ops.topk_rows(s, k, **kw)
    ref = s.topk(k, dim=-1)
    assert torch.equal(vals, ref.values)
    finite = ref.values != float("-inf")
    assert torch.equal(idx[finite], ref.indices[finite])
    assert idx.dtype == torch.int64
    kw = dict(numerics="fp32", kernel=KernelOptions(aiter="auto"))
    assert aiter_ops.use_aiter("topk_rows", s, **policy(kw))
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="auto"))
    assert not aiter_ops.use_aiter("topk_rows", s, **policy(kw))
    aiter_ops.probe.cache_clear()


def _by_expert(weights, indices):
    """A gate's routing with each row's experts in ascending order (the order the MoE sums)."""
    order = indices.argsort(-1)
    return weights.gather(1, order), indices.gather(1, order)


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_moe_gate_on_aiter_routes_as_the_torch_path(aiter_env, score_func):
    """DSV4_AITER=1: the biased gate is one aiter.topk_gating call with the gate's arguments
    (renormalisation off after softmax); the same experts and weights as the torch path (to
    fp32 rounding: the stub computes in float64), whatever order the kernel returns them in."""
    flag_env, install = aiter_env
    stub = install()
    g = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(6, 16, generator=g), torch.randn(16, generator=g) * 0.1
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="0"))
    assert aiter_ops.moe_gate(logits, bias, 4, 2.5, score_func, **kw) is None   # torch's to run
    want = biased_gate(logits, bias, 4, 2.5, score_func)
    assert stub.calls == []
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    got = aiter_ops.moe_gate(logits, bias, 4, 2.5, score_func, **kw)
    assert stub.calls == [("topk_gating", score_func, score_func != "softmax", 2.5)]
    (gw, gi), (ww, wi) = _by_expert(*got), _by_expert(*want)
    assert gi.dtype == torch.int64 and torch.equal(gi, wi)
    torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-7)


def test_the_models_gate_dispatches_only_biased_layers(aiter_env):
    """A biased layer's Gate goes through moe_gate (aiter with the options' aiter="1", same
    routing); a hash layer (experts from the token id) never calls aiter."""
    from dsv4.config import ModelConfig
    from dsv4.layers.moe import Gate
    from dsv4.options import Options
    _, install = aiter_env
    stub = install()
    cfg = ModelConfig.preset("tiny")
    g = torch.Generator().manual_seed(9)
    biased, hashed = Gate(cfg, cfg.n_hash_layers), Gate(cfg, 0)
    assert not biased.hash and hashed.hash
    with torch.no_grad():
        for gate in (biased, hashed):
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
        biased.bias.copy_(torch.randn(biased.bias.shape, generator=g) * 0.1)
        hashed.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, hashed.tid2eid.shape,
                                           generator=g))
    x = torch.randn(5, cfg.dim, generator=g).bfloat16()
    ids = torch.randint(0, cfg.vocab_size, (5,), generator=g)
    off, on = (Options(kernel=KernelOptions(aiter=a)) for a in ("0", "1"))
    want = [gate(x, ids, off) for gate in (biased, hashed)]
    assert stub.calls == []
    got = [gate(x, ids, on) for gate in (biased, hashed)]
    assert [c[0] for c in stub.calls] == ["topk_gating"]
    assert torch.equal(got[1][0], want[1][0]) and torch.equal(got[1][1], want[1][1])
    (gw, gi), (ww, wi) = _by_expert(*got[0]), _by_expert(*want[0])
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-7)


def test_moe_gate_takes_k_from_one_to_the_expert_count(aiter_env):
    """k counts the experts per token: 1 (a top-1 gate) up to all E are routed (by aiter when
    asked, as the torch path), 0 and E + 1 are refused naming k and the range."""
    _, install = aiter_env
    install()
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(4, 8, generator=g), torch.randn(8, generator=g) * 0.1
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    for k in (1, 8):
        (gw, gi), (ww, wi) = (_by_expert(*aiter_ops.moe_gate(logits, bias, k, 1.5, "sigmoid", **kw)),
                              _by_expert(*biased_gate(logits, bias, k, 1.5, "sigmoid")))
        assert gi.shape == (4, k) and torch.equal(gi, wi)
        torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-7)
    for k in (0, 9):
        with pytest.raises(ValueError, match=rf"k={k}: expected an int in \[1, 8\]"):
            aiter_ops.moe_gate(logits, bias, k, 1.5, "sigmoid", **kw)


@pytest.mark.parametrize("args,name", [
    ((torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), 2), "logits"),
    ((torch.zeros(2, 8), torch.zeros(7), 2), "bias"),
    ((torch.zeros(2, 8), torch.zeros(8), 9), "k"),
    ((torch.zeros(2, 8), torch.zeros(8), 0), "k"),
])
def test_moe_gate_bad_input_names_the_argument(flag_env, args, name):
    with pytest.raises(ValueError, match=name):
        aiter_ops.moe_gate(*args, 1.0, "sqrtsoftplus")
    with pytest.raises(ValueError, match="score_func"):
        aiter_ops.moe_gate(torch.zeros(2, 8), torch.zeros(8), 2, 1.0, "relu")


@pytest.mark.gpu
@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_aiter_moe_gate_matches_torch_on_rocm(flag_env, score_func):
    """The real aiter.topk_gating against the torch path, V4-Flash-shaped (256 experts, top 6):
    the same experts per token and the same weights to fp32 rounding."""
    reason = _real_aiter_on_rocm()
    if reason:
        pytest.skip(reason)
    aiter_ops.probe.cache_clear()
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(37, 256, generator=g, device="cuda")
    bias = torch.randn(256, generator=g, device="cuda") * 0.01
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="0"))
    want = biased_gate(logits, bias, 6, 2.5, score_func)
    kw = dict(numerics="reference", kernel=KernelOptions(aiter="1"))
    assert aiter_ops.probe().has("moe_gate")
    (gw, gi), (ww, wi) = _by_expert(*aiter_ops.moe_gate(logits, bias, 6, 2.5, score_func, **kw)), \
        _by_expert(*want)
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-6)
    aiter_ops.probe.cache_clear()
