"""The engine releases SWA pages that left the window while requests decode, and a retracted
request resumes with its KV and compressor state: its logits are bit-equal to those of a run that
never retracted it. Every expectation follows from the window and page arithmetic or from a run
without retraction, never from the output of the code under test."""

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.engine import Engine
from tiny_model import tiny_model

TINY = ModelConfig.preset("tiny")

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

    engine, out = run_engine(model, **ALIGNED, first_ends_after=ALIGNED_RETRACTED_AT - 1,
                             record=record)
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
