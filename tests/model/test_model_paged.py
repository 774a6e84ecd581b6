"""The paged backend (mem_pool caches, prefill then decode) against the dense reference.

Tolerance. Both sides compute in the reference's precisions (bf16 activations and weights, fp32
statistics, FP8 KV rows, FP4 indexer q/k) but not in the same order (batched vs. full-sequence
GEMMs, fused vs. unfused norms), so last-bit differences of bf16 values appear; an FP8 KV element
or an FP4 indexer element near a rounding boundary then lands one step apart (6% or 17% of that
element). Continuous outputs stay close: the logits (std ~1) agree to LOGIT_ATOL = 0.1 absolute,
where the measured worst case is ~0.04. The two discrete choices, the indexer's top-k and the
score-routed experts, can flip between near-tied candidates under that noise (a flip moves a
logit by ~1), so the dense reference is run with the choices the paged backend made, and each of
those choices is checked to be a top-k choice of the dense scores up to a margin: REGRET_TOL of
the scale of the scores compared (measured worst ~0.2 for indexer scores, whose FP4 inputs
amplify the noise; ~0.01 for the gate).
"""

import pytest
import torch

import dense_reference as ref
from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.layers.indexer import Indexer
from dsv4.layers.moe import Gate
from tiny_model import tiny_model

LOGIT_ATOL = 0.1
INDEX_REGRET_TOL = 0.3
ROUTE_REGRET_TOL = 0.02
MAX_LEN = 512

TINY = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=MAX_LEN, seed=1)


class ChoiceRecorder:
    """Records the indexer's top-k and the gate's experts, per layer, in call order."""

    def __init__(self, model, monkeypatch):
        self.picks = {id(l.attn.indexer): (i, []) for i, l in enumerate(model.layers)
                      if l.attn.indexer is not None}
        self.routes = {id(l.ffn.gate): (i, []) for i, l in enumerate(model.layers)
                       if not l.ffn.gate.hash}
        select, gate = Indexer.select, Gate.forward

        def record_select(ind, scores, visible, options, *rest):
            out = select(ind, scores, visible, options, *rest)
            self.picks[id(ind)][1].append(out)
            return out

        def record_gate(g, x, input_ids, options):
            weights, idx = gate(g, x, input_ids, options)
            if id(g) in self.routes:
                self.routes[id(g)][1].append(idx)
            return weights, idx

        monkeypatch.setattr(Indexer, "select", record_select)
        monkeypatch.setattr(Gate, "forward", record_gate)

    def selection(self, T):
        out = {}
        for layer, chunks in self.picks.values():
            rows = [r for chunk in chunks for r in chunk]      # one per query, in order
            assert len(rows) == T, f"layer {layer}: {len(rows)} indexer queries, expected {T}"
            s = torch.zeros(T, T // 4, dtype=torch.bool)
            for t, r in enumerate(rows):
                s[t, r[r >= 0]] = True
            out[layer] = s
        return out

    def routing(self):
        return {layer: torch.cat(chunks) for layer, chunks in self.routes.values()}


def regret(scores, chosen_mask, k):
    """(k-th best score - worst chosen score) / max |score|, per row where choosing happened."""
    worst = 0.0
    for s, m in zip(scores, chosen_mask):
        if s.numel() <= k:
            assert m.all(), "with no more candidates than k, all of them are chosen"
            continue
        assert int(m.sum()) == k
        kth = s.topk(k).values[-1]
        worst = max(worst, float((kth - s[m].min()) / s.abs().max()))
    return worst


def run_and_compare(model, monkeypatch, prompt_len, decode_len, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (prompt_len + decode_len,), generator=g)
    rec = ChoiceRecorder(model, monkeypatch)
    engine = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=False)
    out = engine.generate([tokens[:prompt_len].tolist()], decode_len, return_logits=True,
                          forced_tokens=[tokens[prompt_len:].tolist()])
    T = prompt_len + decode_len - 1            # the last forced token is never fed
    selection, routing = rec.selection(T), rec.routing()
    trace = {}
    want = ref.dense_logits(TINY, model.state_dict(), tokens[:T], selection, routing, trace)
    got = out.logits[0]
    assert got.shape == (decode_len, TINY.vocab_size)
    diff = (got - want[prompt_len - 1:]).abs().max().item()

    index_regret = 0.0
    for layer, sel in selection.items():
        score = trace["index", layer]
        rows = [(score[t, :(t + 1) // 4], sel[t, :(t + 1) // 4]) for t in range(T)]
        index_regret = max(index_regret, regret(*zip(*rows), TINY.index_topk) if rows else 0.0)
    route_regret = 0.0
    for layer, idx in routing.items():
        mask = torch.zeros(T, TINY.n_routed_experts, dtype=torch.bool)
        mask.scatter_(1, idx[:T], True)
        route_regret = max(route_regret, regret(trace["route", layer], mask,
                                                TINY.n_activated_experts))
    return diff, index_regret, route_regret, out


@pytest.mark.parametrize("prompt_len, decode_len", [
    (245, 21),   # prefill crosses the window and C4 boundaries, decode crosses C128 at 256
    (9, 8),      # short prompt: window not full, first compressed rows emitted in decode
])
def test_paged_logits_match_the_dense_reference(model, monkeypatch, prompt_len, decode_len):
    diff, index_regret, route_regret, _ = run_and_compare(model, monkeypatch, prompt_len,
                                                          decode_len, seed=prompt_len)
    assert diff <= LOGIT_ATOL, f"max |logit difference| {diff:.4f} > {LOGIT_ATOL}"
    assert index_regret <= INDEX_REGRET_TOL, f"indexer top-k regret {index_regret:.3f}"
    assert route_regret <= ROUTE_REGRET_TOL, f"expert routing regret {route_regret:.3f}"


def _no_previous_window(kv, score, has_prev, *shape):
    return _POOL(kv, score, torch.zeros_like(has_prev) if has_prev is not None else None, *shape)


def _no_sink(attn, q, kv, valid, reference, *rest):
    with torch.no_grad():
        saved = attn.attn_sink.clone()
        attn.attn_sink.fill_(float("-inf"))
        try:
            return _SPARSE(attn, q, kv, valid, reference, *rest)
        finally:
            attn.attn_sink.copy_(saved)


from dsv4.layers.attention import Attention  # noqa: E402
from hip_kernels import compressor_update  # noqa: E402

_POOL, _SPARSE = compressor_update.pool_windows, Attention.sparse_attention


@pytest.mark.parametrize("target, mutant", [
    (compressor_update, ("pool_windows", _no_previous_window)),  # C4 overlap without the
    #                                                              previous window
    (Attention, ("sparse_attention", _no_sink)),       # the sink left out of the denominator
])
def test_the_comparison_catches_a_semantic_mistake(model, monkeypatch, target, mutant):
    """Proof that the comparison can fail: each mutant of the paged path exceeds LOGIT_ATOL."""
    monkeypatch.setattr(target, *mutant)
    diff, *_ = run_and_compare(model, monkeypatch, 40, 6, seed=5)
    assert diff > LOGIT_ATOL


def test_a_mixed_length_batch_matches_each_request_alone(model):
    """Batch composition changes only the order of fp32 sums (small-M GEMMs take other kernels),
    so per-request logits agree to the same LOGIT_ATOL (measured: ~1e-6 typically, 0.03 worst,
    when a bf16 rounding flips)."""
    g = torch.Generator().manual_seed(11)
    lens, steps = [7, 130, 250], 8
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in lens]
    forced = [torch.randint(0, TINY.vocab_size, (steps,), generator=g).tolist() for _ in lens]
    engine = Engine(model, max_batch=4, max_context_len=MAX_LEN, graph=False)
    together = engine.generate(prompts, steps, return_logits=True, forced_tokens=forced)
    assert together.logits.shape == (3, steps, TINY.vocab_size)
    for i in range(3):
        alone = engine.generate([prompts[i]], steps, return_logits=True, forced_tokens=[forced[i]])
        diff = (together.logits[i] - alone.logits[0]).abs().max().item()
        assert diff <= LOGIT_ATOL, f"request {i} (prompt {lens[i]}): {diff:.4f}"
    assert engine.allocator.full_available_size() == engine.allocator.size_full


def test_greedy_generation_is_deterministic_and_frees_its_pages(model):
    engine = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=False)
    a = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], 5)
    b = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], 5)
    assert a.tokens == b.tokens and all(len(t) == 5 for t in a.tokens) and a.logits is None
    assert engine.allocator.full_available_size() == engine.allocator.size_full
    assert engine.allocator.swa_available_size() == engine.allocator.size_swa
    too_long = engine.generate([[1] * MAX_LEN], 2)   # fails on its own, nothing taken
    assert "exceed max_context_len" in too_long.errors[0] and too_long.tokens == [[]]
    assert engine.allocator.full_available_size() == engine.allocator.size_full


def test_an_extend_that_continues_a_prefix_matches_one_extend(model, flag_env):
    """Chunked prefill: the later chunks read their compressors' earlier windows from the state
    rings. The same ops run on the same rows (identical on this CPU); only GEMM row blocking may
    differ elsewhere, hence LOGIT_ATOL. A property of DSV4_NUMERICS=fp32: with the reference's
    bf16 roundings the chunks' GEMM shapes move near-tied top-k and routing choices."""
    from dsv4.forward_batch import ForwardBatch, ForwardMode

    flag_env(DSV4_NUMERICS="fp32")

    tokens = torch.randint(0, TINY.vocab_size, (270,), generator=torch.Generator().manual_seed(3))
    engine = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=False)

    def extend(slot, prefix, n):
        lens, pre = torch.tensor([prefix + n]), torch.tensor([prefix])
        last = torch.tensor([int(engine.req_to_token[slot, prefix - 1]) if prefix else -1])
        locs = engine.allocator.alloc_extend(pre, lens, last, n)
        engine.req_to_token_pool.write(slot, prefix, locs)
        batch = ForwardBatch(ForwardMode.EXTEND, tokens[prefix:prefix + n],
                             torch.arange(prefix, prefix + n), locs, torch.tensor([slot]), lens,
                             torch.tensor([n]))
        return engine.forward(batch, all_logits=True)

    def run(chunks):
        slot = engine.req_to_token_pool.alloc()
        engine.pool.clear_compressor_state(torch.tensor([slot]))
        out, start = [], 0
        for n in chunks:
            out.append(extend(slot, start, n))
            start += n
        engine.allocator.free(engine.req_to_token[slot, :start].long())
        engine.req_to_token_pool.free(slot)
        return torch.cat(out)

    whole = run([270])
    assert whole.shape == (270, TINY.vocab_size)
    chunked = run([101, 66, 103])          # chunk ends mid-window for C4 and C128
    assert (chunked - whole).abs().max().item() <= LOGIT_ATOL


def static_shape_decode(model, prompts, steps, capture: bool):
    """generate() whose decode steps run the model with graph-static shapes (the batch in fixed
    buffers, max_rows fixed): captured once under the CPU graph emulation and replayed, or (with
    capture=False) run eagerly each step with the same shapes."""
    from dsv4.forward_batch import ForwardBatch, ForwardMode
    from dsv4.graphs.emulation import EmulatedGraph, graph

    engine = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=False)
    names = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
    static = {name: torch.zeros(2, dtype=torch.int64) for name in names}
    max_rows = model.static_max_rows(MAX_LEN)
    captured = {}

    def step():
        b = ForwardBatch(ForwardMode.DECODE, *(static[n] for n in names))
        return model(b, engine.pool, engine.req_to_token, max_rows=max_rows,
                     options=engine.options)

    eager_forward = engine.forward

    def forward(batch, all_logits=False, **kwargs):
        if not batch.is_decode:
            return eager_forward(batch, all_logits, **kwargs)
        for n in names:
            static[n].copy_(getattr(batch, n))
        if not capture:
            return step().clone()
        if not captured:
            step()                                  # warm-up
            g = EmulatedGraph()
            engine.pool.invalidate_loc_cache()
            with graph(g):
                captured["out"] = step()
            captured["graph"] = g
        captured["graph"].replay()
        return captured["out"].clone()

    engine.forward = forward
    return engine.generate(prompts, steps, return_logits=True)


GRAPH_PROMPTS, GRAPH_STEPS = [list(range(1, 131)), list(range(7, 260))], 6


def test_a_decode_step_replays_from_a_captured_graph(model, flag_env):
    """The decode step has no host sync and no data-dependent shape (metadata included) when
    max_rows is fixed: captured once under the CPU graph emulation, replays give eager's logits.
    In DSV4_NUMERICS=fp32, where the indexer's scores are fp32 and do not tie. (The graph's
    compressed segment is wider than eager's: on an Intel Xeon, AVX512 with AMX, torch's softmax
    over the wider row gave the last step's second row other logits, max |diff| 0.033; the
    attention's softmax now sums its denominator in an order the width does not change.)"""
    flag_env(DSV4_NUMERICS="fp32")
    want = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=False).generate(
        GRAPH_PROMPTS, GRAPH_STEPS, return_logits=True)
    got = static_shape_decode(model, GRAPH_PROMPTS, GRAPH_STEPS, capture=True)
    assert got.tokens == want.tokens
    assert torch.equal(got.logits, want.logits)


def test_a_replay_adds_nothing_to_the_static_shapes_in_reference_numerics(model, flag_env):
    """With the reference's roundings the indexer's scores are bf16 and can tie at the k-th
    place; torch.topk then picks among the tied rows by the candidate count, which the graph's
    static shapes change (measured on an AVX2 CPU: row 18 instead of row 1 at the 8th place).
    What a replay must give, bit for bit, is an eager step with those static shapes."""
    flag_env(DSV4_NUMERICS="reference")
    want = static_shape_decode(model, GRAPH_PROMPTS, GRAPH_STEPS, capture=False)
    got = static_shape_decode(model, GRAPH_PROMPTS, GRAPH_STEPS, capture=True)
    assert got.tokens == want.tokens
    assert torch.equal(got.logits, want.logits)
