"""Tests aimed at bugs the rest of the suite let through (mutants that survived it): strided cache
views of the set-KV stores, the Sinkhorn iteration count of mHC, the engine's release of SWA
pages that left the window, retraction round trips checked by logits, the FP8 block size of a
checkpoint, and the disaggregated SWA tail at page and window boundaries.

Every expectation is computed here from the semantics (window, page, block arithmetic) or by an
independent restatement, never copied from the output of the code under test.
"""

import dataclasses
import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dense_reference as ref
import hip_kernels
from hip_kernels import KernelOptions
from dsv4.checkpoint import load_model, save_random_checkpoint
from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.options import Options
from dsv4.layers import mhc
from hip_kernels import mhc_split
from dsv4.weights import quant
from hip_kernels import kv_layout as L
from hip_kernels.backend import resolve
from hip_kernels.platform import default_device
from kv_inputs import (SENTINEL, bf16_rows, clone_args, gen, kv_cache, norm_rope_args, same_bytes,
                       to_device)
from mem_pool import PreallocBudget, swa_tail_len
from mem_pool_testlib import small_pool
from tiny_model import tiny_model

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
if "triton" in BACKENDS:
    from triton_interp_shim import interpreter_shim  # noqa: F401 (autouse fixture)

DEV = default_device()
TINY = ModelConfig.preset("tiny")
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 1. set-KV stores through a strided cache view ------------------------------------------

P, PAGES = 4, 3
GAP = 2 * L.VALUE_BYTES + 16      # pages lie page_bytes(P) + GAP bytes apart: not a 576 multiple
USED = P * L.TOKEN_BYTES          # the bytes of a page the layout uses
# The first and the last slot of every page, one more in the middle and a skipped row (-1). (The
# translating store reserves SWA slot 0 for "unmapped": its row for slot 0 goes to slot 1.)
SLOTS = torch.tensor([0, 3, 4, 7, 8, 11, 5, -1, 10])
STORE_OPS = ("fused_store_cache", "store_kv_pack", "fused_k_norm_rope_store",
             "fused_translate_norm_rope_store")


def store_args(op: str, seed: int = 5) -> dict:
    """Keyword arguments of `op` (cache left out) writing len(SLOTS) rows at SLOTS."""
    g, n = gen(seed), len(SLOTS)
    if op == "fused_store_cache":
        return dict(rows=bf16_rows(g, n, L.HEAD_DIM, pad=64), out_loc=SLOTS, page_size=P)
    if op == "store_kv_pack":
        nope, rope, scales = L.quantize_kv_rows(bf16_rows(g, n, L.HEAD_DIM),
                                                hip_kernels.fp8_dialect())
        return dict(nope_fp8=nope, rope_bf16=rope, scales=scales, out_loc=SLOTS, page_size=P)
    args = norm_rope_args(seed, n, P, PAGES, heads=2 if op == "fused_k_norm_rope_store" else 0)
    del args["cache"]
    if op == "fused_k_norm_rope_store":
        args["out_loc"] = SLOTS
        return args
    # The translating store: full locations mapped onto SLOTS, slot 0 replaced by 1.
    del args["out_loc"]
    swa = torch.where(SLOTS == 0, torch.ones_like(SLOTS), SLOTS)
    full = torch.tensor([6, 2, 9, 0, 12, 14, 1, -1, 3])
    full_to_swa = torch.zeros(16, dtype=torch.int64)
    full_to_swa[full[full >= 0]] = swa[full >= 0]
    args.update(full_loc=full, full_to_swa=full_to_swa)
    return args


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", STORE_OPS)
def test_a_strided_cache_view_gets_the_bytes_of_a_contiguous_cache_and_no_gap_byte(
        flag_env, backend, op):
    """A host engine may hand a view of the used P*584 bytes of pages that lie further apart
    than page_bytes(P). Written through such a view, every page holds byte for byte what a
    contiguous cache holds after the same call, and no byte after the used part of a page (its
    padding and the gap to the next page) changes. Locations on every page, at both ends of
    each, make a wrong page stride or a wrong scale offset visible. (test_set_kv_store_numerics
    covers fused_k_norm_rope_store without a norm weight this way; this covers every store.)"""
    flag_env(DSV4_FP8_DIALECT="ocp")
    options = KernelOptions(backend=backend)
    assert resolve(op, DEV, backend, hip_ok=False) == backend
    args = store_args(op)
    dense = to_device(dict(clone_args(args), cache=kv_cache(PAGES, P)), DEV)
    getattr(hip_kernels, op)(**dense, options=options)
    base = torch.full((PAGES, L.page_bytes(P) + GAP), SENTINEL, dtype=torch.uint8, device=DEV)
    view = base[:, :USED]
    assert not view.is_contiguous() and view.stride(0) == L.page_bytes(P) + GAP
    strided = to_device(dict(clone_args(args), cache=view), DEV)
    getattr(hip_kernels, op)(**strided, options=options)
    dense_cache, base = dense["cache"].cpu(), base.cpu()
    assert (dense_cache[:, :USED] != SENTINEL).any(1).all()     # rows landed on every page
    assert same_bytes(base[:, :USED], dense_cache[:, :USED])
    assert (base[:, USED:] == SENTINEL).all()
    for key in ("q", "swa_loc_out"):
        if dense.get(key) is not None:
            assert same_bytes(strided[key].cpu(), dense[key].cpu())


# ---- 2. mHC: the Sinkhorn iteration count ----------------------------------------------------

SINKHORN_ITERS = 20     # hc_sinkhorn_iters of the published configs (test_model_config)


def sinkhorn_f64(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The reference order in float64: row softmax + eps, a column normalization, then iters-1
    rounds of row and column normalization."""
    c = logits.double().softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def test_sinkhorn_matches_a_float64_restatement_tightly():
    """Comb logits spread wide enough (std 8) that Sinkhorn is still moving at iteration 18: the
    float64 restatement with 18 iterations differs from 20 by far more than the tolerance, so
    running two iterations fewer cannot pass (measured: 1.4e-7 off at 20 iterations, 1.1e-2 at
    18, 5e-3 at 19; tolerance 1e-5)."""
    logits = torch.randn(64, 4, 4, generator=gen(11)) * 8
    want = sinkhorn_f64(logits, SINKHORN_ITERS, 1e-6)
    assert (sinkhorn_f64(logits, SINKHORN_ITERS - 2, 1e-6) - want).abs().max() > 1e-3
    got = mhc_split.sinkhorn_ref(logits, SINKHORN_ITERS, 1e-6, True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_decoder_layer_mhc_runs_the_configured_sinkhorn_and_matches_the_dense_restatement():
    """A decoder layer's mHC (pre weights, post weights, comb, and hc_post) against the dense
    reference's hc_weights / hc_combine / hc_expand run with 20 iterations. The layer's comb base
    is set wide (std 8) and its fn weights larger than the random init's, so the comb is far from
    converged by iteration 18 and a layer that runs fewer iterations than configured (or a config
    of 18) fails: comb moves by ~5e-3 and hc_post by ~2e-2, against tolerances of 1e-6 and
    1e-5 (measured differences at 20 iterations: 0 and 5e-7)."""
    assert TINY.hc_sinkhorn_iters == SINKHORN_ITERS
    cfg20 = dataclasses.replace(TINY, hc_sinkhorn_iters=SINKHORN_ITERS)
    layer = tiny_model(max_seq_len=16, seed=3).layers[1]
    hc, g = TINY.hc_mult, gen(12)
    x = torch.randn(8, hc, TINY.dim, generator=g)
    for part in ("attn", "ffn"):
        fn, base, scale = (getattr(layer, f"hc_{part}_{k}") for k in ("fn", "base", "scale"))
        with torch.no_grad():
            fn.copy_(torch.randn(fn.shape, generator=g) * 0.1)
            base.copy_(torch.randn(base.shape, generator=g) * 8)
            scale.copy_(torch.tensor([1.0, 1.0, 4.0]))
        pre_r, post_r, comb_r = ref.hc_weights(x, fn, scale, base, cfg20)
        comb_18 = ref.hc_weights(x, fn, scale, base,
                                 dataclasses.replace(cfg20, hc_sinkhorn_iters=18))[2]
        assert (comb_18 - comb_r).abs().max() > 1e-3
        y, post, comb = layer._hc_pre(x, part, Options())
        torch.testing.assert_close(comb, comb_r, atol=1e-6, rtol=0)
        torch.testing.assert_close(post, post_r, atol=1e-6, rtol=0)
        torch.testing.assert_close(y, ref.hc_combine(x, pre_r), atol=1e-5, rtol=1e-5)
        out = torch.randn(8, TINY.dim, generator=g)
        torch.testing.assert_close(mhc.hc_post(out, x, post, comb),
                                   ref.hc_expand(out, x, post_r, comb_r), atol=1e-5, rtol=1e-5)
    _, _, comb = layer.attn_input(x, Options())
    torch.testing.assert_close(comb, ref.hc_weights(x, layer.hc_attn_fn, layer.hc_attn_scale,
                                                     layer.hc_attn_base, cfg20)[2],
                               atol=1e-6, rtol=0)


# ---- 3-5. the engine: SWA pages in use, retraction round trips by logits --------------------

MAX_LEN, PAGE = 512, 128
W = TINY.window_size


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=MAX_LEN, seed=1)


def token_lists(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TINY.vocab_size, (n,), generator=g).tolist() for n in lens]


EOS = 1                           # never drawn by token_lists (ids from 2 up)


def run_engine(model, lens, new, pages=None, first_ends_after=None, record=None):
    """generate() of two prompts of the given lengths with forced (teacher) tokens, so every run
    feeds the same tokens whatever its logits. pages=None: a pool that never runs out.
    first_ends_after=k: the first request's token after decode step k is the end token, so it
    leaves the batch there. record(engine), if given, runs after every decode step. Three
    request slots for two requests: a request that is retracted and resumed comes back in
    another slot (3) than the one it left (2), whose compressor state rings it never wrote.
    Returns (engine, output)."""
    forced = token_lists([new] * len(lens), 1)
    if first_ends_after is not None:
        forced[0][first_ends_after] = EOS
    engine = Engine(model, max_batch=3, max_context_len=MAX_LEN, page_size=PAGE, graph=False,
                    max_total_tokens=None if pages is None else pages * PAGE, eos_token_id=EOS)
    out = engine.generate(token_lists(lens, 0), new, return_logits=True, forced_tokens=forced,
                          on_step=None if record is None else lambda: record(engine))
    return engine, out


def all_free(engine) -> bool:
    a = engine.allocator
    return (a.full_available_size() == a.size_full and a.swa_available_size() == a.size_swa
            and engine.req_to_token_pool.available() == engine.max_batch)


# Scenario "aligned": prompts of 250 and 370 tokens, 30 new tokens, a pool of 6 pages. The two
# prompts take 2 + 3 pages; the first request takes the sixth page for position 256 (decode step
# 7); at step 15 the second needs a page for position 384, none is left, and it (the latest
# admitted) is retracted with 384 tokens, three whole pages, long after its first SWA pages left
# the window. It resumes when the first finishes and decodes alone to 399.
ALIGNED = dict(lens=(250, 370), new=30)
ALIGNED_PAGES, ALIGNED_RETRACTED_AT = 6, 15
# Scenario "mid-window": prompts of 120 and 301 tokens, 40 new tokens, a pool of 4 pages, all
# taken by the prompts. At step 9 the first request needs a page for position 128; the second
# (the latest admitted) is retracted with 309 tokens: 309 % 4 = 1 and 309 % 128 = 53, so both
# compressor state rings hold a partial window that the resumed request must get back.
MID = dict(lens=(120, 301), new=40)
MID_PAGES, MID_RETRACTED_AT = 4, 9


@pytest.fixture(scope="module")
def aligned_reference(model):
    """The "aligned" scenario never retracted (a pool that never runs out), the first request
    ending after step 14: (engine, output, SWA tokens in use after every decode step)."""
    in_use = []

    def record(engine):
        a = engine.allocator
        in_use.append(a.size_swa - a.swa_available_size())

    # Set up before the function-scoped one_thread fixture runs: take one thread here too (the
    # tiny model's ops run slower on two).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine, out = run_engine(model, **ALIGNED, first_ends_after=ALIGNED_RETRACTED_AT - 1,
                                 record=record)
    finally:
        torch.set_num_threads(threads)
    return engine, out, in_use


def swa_pages_held(n: int) -> int:
    """SWA pages a request of n stored tokens keeps once the out-of-window ones are released:
    the pages holding the window of its last token (positions n - W .. n - 1), since SWA memory
    is handed out and taken back in whole pages."""
    return len({q // PAGE for q in range(max(0, n - W), n)})


def test_long_decodes_keep_only_the_window_pages_of_the_swa_pool(aligned_reference):
    """Requests decode from 250 to 264 and from 370 to 399 tokens, crossing window + page (256)
    and a page boundary on the way (256, 384). After every decode step the SWA pool holds
    exactly the pages of each running request's last window: never more than ceil(W / P) + 1
    per request, and always every page the next step reads (positions n - W + 1 .. n - 1). An
    engine that never releases out-of-window SWA pages holds 4 pages for the second request by
    its end."""
    engine, out, in_use = aligned_reference
    (first, second), new = ALIGNED["lens"], ALIGNED["new"]
    ends = ALIGNED_RETRACTED_AT - 1
    assert [len(t) for t in out.tokens] == [ends + 1, new]
    assert len(in_use) == new - 1              # one call per decode step
    bound = -(-W // PAGE) + 1
    for step, tokens in enumerate(in_use, start=1):
        running = ([first + step] if step < ends else []) + (
            [second + step] if step < new - 1 else [])
        assert tokens == sum(swa_pages_held(n) for n in running) * PAGE, (step, running)
        for n in running:
            needed = {q // PAGE for q in range(max(0, n - W + 1), n)}
            assert len(needed) <= swa_pages_held(n) <= bound
    assert all_free(engine)


def compare_by_logits(want, got, retracted_at: int) -> None:
    """Logits of a run that retracts the second request at decode step `retracted_at` against
    a run that never retracts, in which the first request ends after step retracted_at - 1.

    Why that reference: the second request then steps with the first up to that step and alone
    from it in both runs, over identical tokens. That matters because an fp32 matmul over one
    row rounds differently from one over two (gemv vs gemm); against a reference that keeps
    both in the batch, the logits drift by ~1e-6, then by 0.03 where a bf16 rounding flips and
    by ~1 where a top-k choice flips (measured with these scenarios, with no retraction at all:
    only the batch differed). With the batches matched the comparison is bit-equal: the whole
    of the second request, and the first one's logits up to the retraction."""
    assert got.logits.shape == want.logits.shape
    assert torch.equal(got.logits[1], want.logits[1])
    assert torch.equal(got.logits[0, :retracted_at], want.logits[0, :retracted_at])


def test_retraction_after_window_and_page_gives_the_logits_of_a_run_never_retracted(
        model, aligned_reference):
    """The "aligned" scenario: the retracted request holds 384 tokens, of which only the last
    page still has SWA rows; its host copy goes back into fresh pages and its logits at every
    step are bit-equal to those of the run never retracted."""
    _, want, _ = aligned_reference
    engine, got = run_engine(model, **ALIGNED, pages=ALIGNED_PAGES)
    assert engine.stats.retractions == engine.stats.resumptions == 1
    assert [len(t) for t in got.tokens] == [ALIGNED["new"]] * 2
    compare_by_logits(want, got, ALIGNED_RETRACTED_AT)
    assert all_free(engine)


def test_a_request_retracted_mid_window_resumes_with_its_compressor_state(model):
    """The "mid-window" scenario: the request retracted at 309 tokens has partial windows in its
    C4, C128 and indexer compressor rings; resumed, its logits are bit-equal to those of the
    run never retracted, so a resume that drops or clears the rings is caught (by logits: the
    greedy tokens alone often survive it)."""
    _, want = run_engine(model, **MID, first_ends_after=MID_RETRACTED_AT - 1)
    engine, got = run_engine(model, **MID, pages=MID_PAGES)
    assert engine.stats.retractions == engine.stats.resumptions == 1
    compare_by_logits(want, got, MID_RETRACTED_AT)
    assert all_free(engine)


# ---- 6. the FP8 block size of a checkpoint ---------------------------------------------------

BLOCK = (32, 64)                  # not the default (128, 128), and not square
FP8_NAMES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
             "attn.wo_b.weight")


def dequant_blocks(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float64 value of an FP8 weight with one ue8m0 scale per block[0] x block[1] tile, by
    index arithmetic."""
    rows = torch.arange(q.shape[0])[:, None] // block[0]
    cols = torch.arange(q.shape[1])[None, :] // block[1]
    exp = scale.view(torch.uint8).to(torch.float64) - 127
    return q.to(torch.float64) * torch.pow(2.0, exp)[rows, cols]


def test_a_checkpoint_with_another_fp8_block_size_loads_its_exact_dequantization(tmp_path):
    """A checkpoint whose config says weight_block_size [32, 64]: its FP8 projections carry one
    scale per 32x64 tile. The loaded model holds exactly those tiles' dequantization (and every
    other tensor as saved); a loader that assumes 128x128 tiles refuses the scale shapes or
    scales whole 128x128 areas by one tile's scale."""
    path = save_random_checkpoint(TINY, tmp_path, seed=7, shards=1)
    tensors = load_file(path / "model.safetensors")
    expected, differs_from_default = dict(tensors), False
    for name in list(tensors):
        if not name.endswith(FP8_NAMES):
            continue
        w = tensors[name]
        q, scale = quant.quant_fp8(w, BLOCK)
        assert scale.shape == (-(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1]))
        tensors[name], tensors[name[:-len("weight")] + "scale"] = q, scale
        deq = dequant_blocks(q, scale, BLOCK)
        assert ((deq - w.double()).norm() / w.double().norm()) < 0.05      # a sane encoding
        expected[name] = deq.to(w.dtype)
        # Tiles of one 128x128 area have different scales: the block size matters here.
        differs_from_default |= bool((scale[:4, :2] != scale[0, 0]).any())
    assert differs_from_default
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": list(BLOCK)}
    (path / "config.json").write_text(json.dumps(config))
    state = load_model(path).state_dict()
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        assert torch.equal(state[name], want), name


# ---- 7. the disaggregated SWA tail at page and window boundaries -----------------------------

TAIL_PAGE = 16


def boundary_cases():
    """(seq_len, window): one below, at and one above the window, the window plus a page, and
    a page boundary far past the window, for a window that is a whole number of pages and one
    that is not."""
    for window in (32, 40):
        for edge in (window, window + TAIL_PAGE, 6 * TAIL_PAGE):
            for seq_len in (edge - 1, edge, edge + 1):
                yield seq_len, window


def window_pages(seq_len: int, window: int) -> set[int]:
    """The pages holding the window of the last prompt token: positions seq_len - window ..
    seq_len - 1 (all of them when the prompt is shorter than the window)."""
    return {q // TAIL_PAGE for q in range(max(0, seq_len - window), seq_len)}


@pytest.mark.parametrize("seq_len, window", list(boundary_cases()))
def test_the_disaggregated_swa_tail_covers_the_last_window_in_whole_pages(seq_len, window):
    """The decode side gets SWA slots for exactly the positions that lie on a page holding part of
    the last prompt token's window (so every position the first decoded token attends, seq_len -
    window + 1 .. seq_len - 1, has one); every other position has none, and SWA slots keep their
    full location's in-page offset. The tail length and the pages charged follow."""
    pages = window_pages(seq_len, window)
    with_swa = [q for q in range(seq_len) if q // TAIL_PAGE in pages]
    assert with_swa == list(range(seq_len - len(with_swa), seq_len))      # a tail, by design
    assert set(range(max(0, seq_len - window + 1), seq_len)) <= set(with_swa)
    assert swa_tail_len(seq_len, window, TAIL_PAGE) == len(with_swa)

    _, al = small_pool((0,), full_tokens=8 * TAIL_PAGE, swa_tokens=8 * TAIL_PAGE,
                       page_size=TAIL_PAGE)
    budget = PreallocBudget.from_allocator(al)
    lens = budget.try_reserve(seq_len, window)
    assert (lens.full_len, lens.swa_len) == (seq_len, len(with_swa))
    locs = al.alloc_extend_swa_tail(seq_len, lens.swa_len)
    assert locs.numel() == seq_len
    swa = al.full_to_swa_index_mapping[locs]
    assert [q for q in range(seq_len) if swa[q] > 0] == with_swa
    assert torch.equal(swa[swa > 0] % TAIL_PAGE, locs[swa > 0] % TAIL_PAGE)
    assert al.swa_available_size() == al.size_swa - len(pages) * TAIL_PAGE
    assert al.full_available_size() == al.size_full - -(-seq_len // TAIL_PAGE) * TAIL_PAGE
    assert (budget.full_tokens, budget.swa_tokens) == (al.full_available_size(),
                                                       al.swa_available_size())
