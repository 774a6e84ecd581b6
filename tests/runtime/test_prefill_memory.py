"""What an extend step allocates, measured on the CPU from the torch profiler's allocation
records, against what `dsv4.memory_estimate` says it needs: the estimate is an upper bound and
not a loose one; no tensor of a chunk is sized by its tokens times the context's compressed
rows; and the pieces an extend is attended in bound its memory without changing a bit."""

import dataclasses

import pytest
import torch

import dsv4.paged_attention as paged_attention
from dsv4 import DeepseekV4Model, init_random_weights
from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.memory_estimate import prefill_bytes
from peak_memory import peak_allocated_bytes, recorded_shapes
from tiny_model import all_free, prompts

TINY = ModelConfig.preset("tiny")
WIDE = dataclasses.replace(TINY, n_heads=8, dim=128, index_n_heads=16)   # other proportions


def engine(config, context, chunk, seed=3):
    model = init_random_weights(DeepseekV4Model(config, max_seq_len=context + 8), seed=seed)
    return Engine(model, max_batch=1, max_context_len=context + 8, page_size=128, graph=False,
                  prefill_chunk=chunk)


@pytest.mark.parametrize("config, context, chunk", [(TINY, 1024, 1024), (TINY, 2048, 256),
                                                    (WIDE, 1536, 512)],
                         ids=["tiny-1k-whole", "tiny-2k-chunks", "wide-1.5k-chunks"])
def test_the_estimate_bounds_what_a_prefill_allocates(config, context, chunk):
    """The largest allocation above the start while a prompt of `context` tokens is prefilled
    in chunks of `chunk` (and one token decoded) is at most the estimate's prefill share, and
    at least half of it."""
    e = engine(config, context, chunk)
    peak, _ = peak_allocated_bytes(e.generate, prompts([context]), 1)
    estimate = prefill_bytes(config, chunk, context)
    assert peak <= estimate <= 2 * peak, (peak, estimate)
    assert all_free(e)


def test_no_tensor_of_a_chunk_is_sized_by_its_tokens_times_the_compressed_rows():
    """A prompt of 1000 tokens (250 ratio-4 rows) in chunks of 600: no op of the prefill sees
    a tensor with a dimension of a chunk's token count (600, 400) and one of 250; the rows are
    per request tables, read per piece of queries."""
    e = engine(TINY, 1000, 600)
    shapes, _ = recorded_shapes(e.generate, prompts([1000]), 1)
    assert e.stats.prefill_chunks == [600, 400]
    tokens_by_rows = [s for s in shapes if 250 in s and ({600, 400} & set(s))]
    assert not tokens_by_rows, tokens_by_rows[:5]
    assert any(250 in s for s in shapes)        # the tables are there, per request


@pytest.mark.parametrize("numerics", ["reference", "fp32"])
def test_smaller_pieces_allocate_less_and_compute_the_same_bits(monkeypatch, flag_env,
                                                                  numerics):
    """The piece bounds are what bounds an extend's memory: with them eight times smaller, a
    prompt's prefill allocates less and its logits are the same, bit for bit."""
    flag_env(DSV4_NUMERICS=numerics)
    prompt = prompts([900])

    def run():
        e = engine(TINY, 900, 1024)
        return peak_allocated_bytes(e.generate, prompt, 2, return_logits=True)

    peak, whole = run()
    for name in ("EXTEND_PIECE", "EXTEND_SCORE_PAIRS", "EXTEND_ROW_PAIRS"):
        monkeypatch.setattr(paged_attention, name, getattr(paged_attention, name) // 8)
    small_peak, small = run()
    assert small_peak < 0.8 * peak
    assert small.tokens == whole.tokens
    assert torch.equal(small.logits, whole.logits)
