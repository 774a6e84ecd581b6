"""Chunked prefill in the engine: a prompt prefilled in several chunks gives the tokens of one
extend over it; each step decodes the running requests first and gives the prefilling prompts
what is left of its token budget; the prefilling prompt's SWA pages leave with the window;
a pool that runs short sends a prefilling prompt back to the queue; bad chunk values are refused
by name; the memory estimate counts one chunk."""

import pytest
import torch

from dsv4 import DeepseekV4Model, Options, init_random_weights
from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.memory_estimate import (MAX_AUTO_CHUNK, auto_prefill_chunk, estimate, piece_bytes,
                                  prefill_bytes, table_bytes, token_bytes)
from tiny_model import all_free, prompts, tiny_model

TINY = ModelConfig.preset("tiny")
MAX_LEN = 704


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(max_seq_len=MAX_LEN, seed=3)


@pytest.fixture(scope="module")
def small():
    model = DeepseekV4Model(ModelConfig.preset("small"), max_seq_len=MAX_LEN, weights="native")
    return init_random_weights(model, seed=3)


def run(model, reqs, chunk, new=4, **kw):
    """Each prompt alone, in an engine prefilling in chunks of `chunk`: (tokens, the engine)."""
    engine = Engine(model, max_batch=kw.pop("max_batch", 1), max_context_len=MAX_LEN,
                    page_size=kw.pop("page_size", 128), graph=False, prefill_chunk=chunk, **kw)
    out = [engine.generate([p], new).tokens[0] for p in reqs]
    assert all_free(engine)
    return out, engine


@pytest.mark.parametrize("numerics", ["reference", "fp32"])
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_a_prompt_in_several_chunks_gives_the_bits_of_one_extend(request, flag_env, preset,
                                                                  numerics):
    """Prompts of 300 and 600 tokens, in chunks of 128 and 256, against one chunk each (bf16
    weights on tiny, the published FP8/FP4 on small): the same tokens and the same logits, bit
    for bit. Each chunk's metadata is sized by the whole prompt (ForwardBatch.prompt_lens): sized
    by the chunk's end, as a plain extend over cached tokens is, the indexer's top-k ran over
    fewer candidates and the C128 attention's softmax over fewer padding columns, whose order
    of summation torch picks by the row length (measured: logits up to 0.04 apart on tiny, 0.27
    on small, where the FP8 activations turn an ulp into a quantization step)."""
    flag_env(DSV4_NUMERICS=numerics)
    model = request.getfixturevalue(preset)
    for prompt in prompts([300, 600]):
        engine = Engine(model, max_batch=1, max_context_len=MAX_LEN, page_size=128,
                        graph=False, prefill_chunk=1024)
        whole = engine.generate([prompt], 4, return_logits=True)
        assert engine.stats.prefill_chunks == [len(prompt)]
        for chunk in (128, 256):
            engine = Engine(model, max_batch=1, max_context_len=MAX_LEN, page_size=128,
                            graph=False, prefill_chunk=chunk)
            got = engine.generate([prompt], 4, return_logits=True)
            n = len(prompt)
            assert engine.stats.prefill_chunks == [chunk] * (n // chunk) + [n % chunk]
            assert got.tokens == whole.tokens, (chunk, n)
            assert torch.equal(got.logits, whole.logits), (chunk, n)
            assert all_free(engine)


def test_a_prompt_shorter_than_the_window_in_chunks_gives_the_bits_of_one_extend(tiny, flag_env):
    """A 96-token prompt (the window is 128) in chunks of 32: the reference prefills it in one
    step, whose queries walk min(96, 128) = 96 window columns before the compressed rows; each
    chunk's queries walk as many (ForwardBatch.prompt_lens). Before, the first chunk walked 32
    and the later ones the whole window, which put the compressed rows in another 64-row block
    of the reference's attention (logits up to 0.027 apart on this prompt). The fp32 numerics
    walk one softmax over all rows, whatever the width. (96 = 3 x 32: a remainder chunk of a
    few rows can round otherwise, see docs/numerics.md, "Chunked prefill".)"""
    flag_env(DSV4_NUMERICS="reference")
    prompt = prompts([96], seed=2)[0]
    whole, _ = run_logits(tiny, prompt, 1024)
    got, engine = run_logits(tiny, prompt, 32)
    assert engine.stats.prefill_chunks == [32, 32, 32]
    assert got.tokens == whole.tokens
    assert torch.equal(got.logits, whole.logits)


def test_a_chunk_walks_the_window_columns_of_its_whole_prompt():
    """prefill_window_width: min(prompt_len, window) for every chunk of a prompt (a first chunk,
    a later one, a whole short prompt); without prompt_lens (a plain extend), the new tokens' own
    count from position 0 and the whole window over a cached prefix."""
    from dsv4.attention_metadata import prefill_window_width
    from dsv4.forward_batch import ForwardBatch, ForwardMode

    def batch(prompt_lens):
        new, seq = torch.tensor([32, 32, 50, 20]), torch.tensor([32, 96, 50, 220])
        return ForwardBatch(ForwardMode.EXTEND, input_ids=torch.zeros(134, dtype=torch.long),
                            positions=torch.zeros(134, dtype=torch.long),
                            out_cache_loc=torch.zeros(134, dtype=torch.long),
                            req_pool_indices=torch.arange(4), seq_lens=seq, extend_seq_lens=new,
                            prompt_lens=prompt_lens)

    chunked = prefill_window_width(batch(torch.tensor([100, 300, 50, 220])), 128)
    assert chunked.tolist() == [100, 128, 50, 128]
    assert prefill_window_width(batch(None), 128).tolist() == [32, 128, 50, 128]


def run_logits(model, prompt, chunk, new=4):
    """One prompt in an engine prefilling in chunks of `chunk`: (its GenerateOutput with the
    logits, the engine)."""
    engine = Engine(model, max_batch=1, max_context_len=MAX_LEN, page_size=128, graph=False,
                    prefill_chunk=chunk)
    out = engine.generate([prompt], new, return_logits=True)
    assert all_free(engine)
    return out, engine


def test_decodes_go_first_and_the_long_prompt_takes_the_rest_of_the_budget(tiny, flag_env):
    """A short prompt and a long one, budget 128: the first step prefills the short prompt whole
    and the long one's first 112 tokens (118 fit, a chunk ends on a multiple of 8); from then on
    each step decodes the short request (one token) and gives the long prompt 120 of the 127
    tokens left, so the short one gains a token every step while the long one prefills, not
    after it."""
    flag_env()
    engine = Engine(tiny, max_batch=2, max_context_len=MAX_LEN, page_size=128, graph=False,
                    prefill_chunk=128)
    seen = []
    out = engine.generate(prompts([10, 500]), 8,
                          on_step=lambda: seen.append(len(engine.stats.prefill_s)))
    assert engine.stats.prefill_chunks == [10 + 112, 120, 120, 120, 28]
    assert seen[:5] == [1, 2, 3, 4, 5]      # one prefill chunk after each decode step
    assert [len(t) for t in out.tokens] == [8, 8]
    assert all_free(engine)


def test_a_prompt_progresses_whatever_the_decodes_take(tiny, flag_env):
    """Three 2-token prompts and a long one. Budget 8: the first step prefills the short ones
    (6 tokens; the 2 left would end the long one's chunk off a multiple of 8); then, with 3
    requests decoding, the long prompt still gets min_prefill_share (8 tokens: an eighth of the
    chunk, at least 8) a step. Budget 64: 6 + 56 (58 fit), then 56 of the 61 left by the
    decodes, then the last 7."""
    flag_env()
    for chunk, long, chunks in ((8, 40, [6, 8, 8, 8, 8, 8]), (64, 119, [6 + 56, 56, 7])):
        engine = Engine(tiny, max_batch=4, max_context_len=MAX_LEN, page_size=128, graph=False,
                        prefill_chunk=chunk)
        assert engine.min_prefill_share == 8
        out = engine.generate(prompts([2, 2, 2, long]), 6)
        assert engine.stats.prefill_chunks == chunks
        assert [len(t) for t in out.tokens] == [6] * 4 and all_free(engine)


def test_a_prefilling_prompt_holds_about_a_chunk_and_a_window_of_swa_slots(tiny, flag_env):
    """600 tokens in chunks of 128 with 128-token pages: the full side holds the whole prompt,
    the SWA side at most the window (128) and the chunk, plus the page the window's start
    rounds down to."""
    flag_env()
    _, engine = run(tiny, prompts([600]), 128, new=2)
    assert engine.stats.peak_full_tokens == 640
    assert engine.stats.peak_swa_tokens <= 128 + 128 + 128


def test_a_short_pool_sends_the_prefilling_prompt_back_to_the_queue(tiny, flag_env):
    """A 6-page pool (128-token pages), chunks of 100: a 511-token prompt (4 pages) ends its
    prefill with a 250-token one's first 89 tokens; the next step the 250-token prompt reaches
    188 tokens (2 pages, the pool is full), and the step after, the first request's decode
    needs a fifth page at position 512. It can only come from the prefilling prompt: that goes
    back to the queue, and is prefilled again once the first request ends. Each request's
    tokens are those it gets alone (fp32 numerics: batch mates change the reference's
    roundings)."""
    flag_env(DSV4_NUMERICS="fp32")
    reqs = prompts([511, 250])
    alone, _ = run(tiny, reqs, 100, new=12)
    engine = Engine(tiny, max_batch=2, max_context_len=MAX_LEN, page_size=128, graph=False,
                    prefill_chunk=100, max_total_tokens=6 * 128)
    out = engine.generate(reqs, 12)
    assert engine.stats.requeued == 1 and engine.stats.retractions == 0
    assert out.errors == [None, None] and out.tokens == alone
    assert all_free(engine)


def test_the_prefix_cache_takes_the_pages_chunks_compute(tiny, flag_env):
    """Chunks of 100 with a prefix cache end on multiples of the ring (96, 192, ...), so each
    page end's ring rows come from one chunk; the pages they complete are inserted, and the
    same prompt again loads 4 pages (512 tokens) and gives the tokens of a run without a cache
    in the same chunks, bit for bit (a page whose rows or rings were captured wrong moves them)."""
    from mem_pool.prefix import PrefixCache

    flag_env(DSV4_NUMERICS="reference")
    prompt = prompts([600], seed=5)[0]
    plain = Engine(tiny, max_batch=1, max_context_len=MAX_LEN, page_size=128, graph=False,
                   prefill_chunk=96, prefix_cache=False)     # the cached run's chunks
    want = plain.generate([prompt], 4, return_logits=True)
    cache = PrefixCache(128, TINY.window_size, host_capacity_pages=16)
    engine = Engine(tiny, max_batch=1, max_context_len=MAX_LEN, page_size=128, graph=False,
                    prefill_chunk=100, prefix_cache=cache)
    first = engine.generate([prompt], 4, return_logits=True)
    assert engine.stats.prefill_chunks == [96] * 6 + [24]
    assert torch.equal(first.logits, want.logits)   # capturing and inserting change nothing
    engine.stats.prefill_chunks.clear()
    again = engine.generate([prompt], 4, return_logits=True)
    assert engine.stats.prefix_hit_tokens == 512 and engine.stats.prefill_chunks == [88]
    assert again.tokens == want.tokens
    assert torch.equal(again.logits, want.logits)
    assert all_free(engine)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_engine_refuses_a_bad_prefill_chunk(tiny, bad):
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(tiny, max_batch=1, max_context_len=MAX_LEN, graph=False, prefill_chunk=bad)


@pytest.mark.parametrize("bad", [-1, 2.0, False])
def test_options_refuse_a_bad_prefill_chunk(bad):
    with pytest.raises(ValueError, match="prefill_chunk"):
        Options(prefill_chunk=bad)


def test_the_chunk_follows_the_options_and_auto_sizes_it(tiny):
    assert Engine(tiny, max_batch=1, max_context_len=MAX_LEN, graph=False,
                  options=Options(prefill_chunk=96)).prefill_chunk == 96
    auto = Engine(tiny, max_batch=1, max_context_len=MAX_LEN, graph=False,
                  options=Options(prefill_chunk=0))
    assert auto.prefill_chunk == MAX_AUTO_CHUNK     # a CPU machine's memory holds 4096 easily


def test_the_auto_chunk_is_sized_for_every_request_the_engine_takes(tiny, monkeypatch):
    """The engine sizes its chunk for max_batch requests (their row tables) on its model's
    ranks, as the CLI's estimate does for its prompts."""
    import dsv4.engine as engine_module

    asked = []

    def recorded(*args, **kwargs):
        asked.append(kwargs)
        return 256

    monkeypatch.setattr(engine_module, "auto_prefill_chunk", recorded)
    engine = Engine(tiny, max_batch=3, max_context_len=MAX_LEN, graph=False,
                    options=Options(prefill_chunk=0))
    assert engine.prefill_chunk == 256
    assert asked == [{"batch": 3, "tp": 1}]


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "abc", ""])
def test_cli_refuses_a_bad_prefill_chunk_in_one_line(capsys, flag_env, monkeypatch, value):
    import dsv4
    from dsv4.cli import main

    flag_env()
    monkeypatch.setattr(dsv4, "DeepseekV4Model", None)   # nothing may be built
    assert main(["generate", "--quiet", "--preset", "tiny", "--prefill-chunk", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefill-chunk" in err[0] and repr(value) in err[0]


def test_cli_refuses_a_chunk_the_device_cannot_hold(capsys, flag_env, monkeypatch):
    import dsv4
    from dsv4.cli import main

    flag_env()
    monkeypatch.setattr(dsv4, "DeepseekV4Model", None)
    assert main(["generate", "--quiet", "--preset", "tiny", "--batch", "1", "--prompt-len",
                 "60000", "--device-memory", "1", "--prefill-chunk", "60000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefill-chunk" in err[0] and "prefill step" in err[0]


def test_estimate_counts_one_chunk_and_the_auto_rule():
    """The prefill share is one chunk's tokens, its requests' row tables and one attention
    piece (or all the prompt tokens', when fewer); auto picks the largest power of two whose
    share fits beside the weights, the KV and the 5% margin."""
    tiny, ctx = TINY, 65_536
    one = prefill_bytes(tiny, 512, ctx)
    assert one == 512 * token_bytes(tiny) + table_bytes(tiny, ctx) + piece_bytes(tiny, ctx)
    assert prefill_bytes(tiny, 1024, ctx) - one == 512 * token_bytes(tiny)   # linear in the chunk
    assert prefill_bytes(tiny, 512, ctx, batch=3) - one == 2 * table_bytes(tiny, ctx)
    assert estimate(tiny, 1, ctx, prefill_tokens=512).prefill_bytes == one
    device, used = 2 ** 30, 2 ** 29
    chunk = auto_prefill_chunk(tiny, ctx, device, used)
    spare = device * 0.95 - used
    assert chunk in (256, 512, 1024, 2048)
    assert prefill_bytes(tiny, chunk, ctx) <= spare < prefill_bytes(tiny, 2 * chunk, ctx)
    assert auto_prefill_chunk(tiny, 512, 2 ** 40, 0) == MAX_AUTO_CHUNK
    assert auto_prefill_chunk(tiny, ctx, 2 ** 30, 2 ** 30, page_size=128) == 128  # none fits


@pytest.mark.parametrize("prompt_len, chunk, share_gib", [(131_072, 4096, 1.65),
                                                     (1_000_000, 4096, 1.62)])
def test_flash_at_long_context_fits_one_192_gib_device(capsys, flag_env, prompt_len, chunk,
                                                       share_gib):
    """The estimate of one Flash request on a 192 GiB device: the auto chunk's prefill step
    fits beside 148.7 GiB of weights and the KV pool (27 GiB at 1M), where one step over the
    whole prompt needed 132 GiB at 128K and 7.7 TiB at 1M (and chunks whose metadata grew
    with the chunk times the context 8.25 GiB at 128K): the share is now set by the chunk."""
    import json

    from dsv4.cli import main

    flag_env()
    assert main(["generate", "--preset", "flash", "--batch", "1", "--prompt-len",
                 str(prompt_len), "--estimate-only", "--device-memory", "192", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().rsplit("\n", 1)[1])
    assert r["fits"] and r["prefill_chunk"] == chunk
    share = r["total_bytes_per_rank"] - r["weight_bytes_per_rank"] - r["kv_bytes"]
    assert round(share / 2 ** 30, 2) == share_gib
