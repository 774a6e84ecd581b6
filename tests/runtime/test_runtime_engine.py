"""Engine scheduling: retraction to host and resume give the tokens of an unconstrained run,
requests queue for slots, an end token stops a request early, and the pool is sized from a byte
budget. Every run ends with every page free."""

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.engine import Engine
from tiny_model import all_free, prompts, tiny_model

TINY = ModelConfig.preset("tiny")
MAX_LEN, PAGE = 256, 128


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=MAX_LEN, seed=1)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_retraction_and_resume_give_identical_tokens(model, flag_env, graph):
    """3 prompts of ~100 tokens fill 3 of 4 pages; at token 128 each needs a second page, so the
    latest is retracted to the host and resumed once the others finish.

    The resumed request decodes in smaller batches than in the run without retraction, so the
    tokens are equal only where a request's output does not depend on its batch mates:
    DSV4_NUMERICS=fp32. (With the reference's roundings the GEMMs' row counts change the bits,
    CPU-dependently; test_runtime_swa_release_and_retraction compares retraction in that mode
    with the batch history held equal, logits bit for bit.)"""
    flag_env(DSV4_NUMERICS="fp32")
    reqs, new = prompts([100, 105, 110]), 40
    big = Engine(model, max_batch=4, max_context_len=MAX_LEN, page_size=PAGE, graph=graph)
    want = big.generate(reqs, new)
    small = Engine(model, max_batch=4, max_context_len=MAX_LEN, page_size=PAGE,
                   max_total_tokens=4 * PAGE, graph=graph)
    got = small.generate(reqs, new)
    assert small.stats.retractions >= 1 and small.stats.resumptions == small.stats.retractions
    assert big.stats.retractions == 0
    assert got.tokens == want.tokens
    assert all_free(small)


def test_a_request_too_large_for_the_pool_fails_alone_and_frees(model):
    """The pool holds one page: the 100-token prompt fits, its 128th token does not. It fails
    with its error and its tokens so far; a small request beside it completes as alone."""
    engine = Engine(model, max_batch=2, max_context_len=MAX_LEN, page_size=PAGE,
                    max_total_tokens=PAGE, graph=False)
    out = engine.generate(prompts([100]), 40)
    assert out.errors[0].startswith("KV pool exhausted: request 0 alone needs more than")
    assert len(out.tokens[0]) == PAGE - 100 + 1
    assert all_free(engine)


def test_more_prompts_than_slots_queue(model, flag_env):
    """Queued requests give the tokens of a run with a slot each. The batches differ between the
    two runs, so this holds in DSV4_NUMERICS=fp32 (see the retraction test)."""
    flag_env(DSV4_NUMERICS="fp32")
    reqs = prompts([30, 40, 50])
    want = Engine(model, max_batch=4, max_context_len=MAX_LEN, graph=False).generate(reqs, 6)
    engine = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=False)
    assert engine.generate(reqs, 6).tokens == want.tokens
    assert all_free(engine)


def test_an_end_token_stops_its_request_early(model):
    reqs = prompts([30, 40])
    engine = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=False)
    full = engine.generate(reqs, 8, return_logits=True)
    eos = full.tokens[0][2]
    stopping = Engine(model, max_batch=2, max_context_len=MAX_LEN, graph=False, eos_token_id=eos)
    out = stopping.generate(reqs, 8, return_logits=True)
    assert out.tokens[0] == full.tokens[0][:full.tokens[0].index(eos) + 1]
    cut = full.tokens[1].index(eos) + 1 if eos in full.tokens[1] else 8
    assert out.tokens[1] == full.tokens[1][:cut]
    assert torch.isnan(out.logits[0, len(out.tokens[0]):]).all()
    assert all_free(stopping)


def test_the_pool_is_sized_from_a_byte_budget(model):
    budget = 6 * 2**20
    engine = Engine(model, max_batch=2, page_size=PAGE, kv_bytes=budget, graph=False)
    assert engine.pool.nbytes <= budget
    more = Engine(model, max_batch=2, page_size=PAGE, kv_bytes=2 * budget, graph=False)
    assert more.allocator.size_full > engine.allocator.size_full
    with pytest.raises(ValueError, match="budget_bytes=1000"):
        Engine(model, max_batch=2, page_size=PAGE, kv_bytes=1000, graph=False)
    with pytest.raises(ValueError, match="not both"):
        Engine(model, max_batch=2, kv_bytes=budget, max_total_tokens=PAGE, graph=False)


@pytest.mark.parametrize("bad, error", [
    ([5, 6.0, 7], "holds 6.0: token ids are ints in 0..{last}"),
    ([5, -1], "holds -1: token ids are ints in 0..{last}"),
    ([5, TINY.vocab_size], f"holds {TINY.vocab_size}: token ids are ints in 0..{{last}}"),
    ([5, True], "holds True: token ids are ints in 0..{last}"),
    ("hello", "must be a non-empty list of token ids"),
    ([], "must be a non-empty list of token ids"),
    ([7] * (MAX_LEN + 1), "exceed max_context_len=256"),
])
def test_a_bad_request_fails_alone_and_the_others_complete_as_alone(model, flag_env, bad, error):
    """"As alone": the same tokens as without the batch mates, a property of DSV4_NUMERICS=fp32
    (with the reference's roundings a request's output depends on its batch, as the reference's
    own does)."""
    flag_env(DSV4_NUMERICS="fp32")
    good = prompts([30, 45])
    engine = Engine(model, max_batch=4, max_context_len=MAX_LEN, page_size=PAGE, graph=False)
    alone = [engine.generate([p], 6).tokens[0] for p in good]
    out = engine.generate([good[0], bad, good[1]], 6, return_logits=True)
    assert out.errors[0] is None and out.errors[2] is None
    assert out.errors[1].startswith("prompt_token_ids[1]")
    assert error.format(last=TINY.vocab_size - 1) in out.errors[1]
    assert out.tokens == [alone[0], [], alone[1]]
    assert torch.isnan(out.logits[1]).all()
    assert all_free(engine)


def test_mistakes_of_the_call_itself_raise(model):
    engine = Engine(model, max_batch=2, max_context_len=MAX_LEN, page_size=PAGE, graph=False)
    for prompts_arg in ("hello", [], None):
        with pytest.raises(ValueError, match="prompt_token_ids must be a non-empty list"):
            engine.generate(prompts_arg, 2)
    for n in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 1, got"):
            engine.generate([[1, 2]], n)
    with pytest.raises(ValueError, match=rf"forced_tokens\[1\] holds {TINY.vocab_size}: token"):
        engine.generate([[1, 2], [3]], 2, forced_tokens=[[1, 2], [4, TINY.vocab_size]])
    with pytest.raises(ValueError, match=r"forced_tokens\[0\] holds 2.0"):
        engine.generate([[1, 2]], 2, forced_tokens=[[1, 2.0]])
    assert all_free(engine)
    for name in ("max_batch", "page_size"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got 0"):
            Engine(model, **{"max_batch": 2, "page_size": PAGE, name: 0}, graph=False)


def test_the_engine_forward_reads_no_location_back_to_the_host(model, monkeypatch):
    """Locations come from the allocator, which checked them when it handed them out: the
    model forward does no per-store range read (a host sync each on a GPU)."""
    import hip_kernels.checks as checks

    def no_read(*args, **kwargs):
        raise AssertionError("a range check read values inside the engine's forward")
    engine = Engine(model, max_batch=2, max_context_len=MAX_LEN, page_size=PAGE, graph=False)
    forward = engine.forward

    def forward_without_reads(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(checks, "check_slot_values", no_read)
            m.setattr(torch, "aminmax", no_read)      # the position and translation range reads
            return forward(*args, **kwargs)
    engine.forward = forward_without_reads
    out = engine.generate(prompts([20, 9]), 4)
    assert out.errors == [None, None] and all(len(t) == 4 for t in out.tokens)
