"""A replayed decode graph gives eager decode's bits (issue 27): the same greedy tokens and the
same logits, in both numerics, at every batch size up to max_batch, for prompts shorter and
longer than the 128-token window whose decode crosses the window, a 128-token compressed block
and 4-token ones (tiny preset, random weights, graphs emulated on the CPU).

A graph's static shapes hold more compressed rows than eager's (``static_max_rows``); their
padding columns must change nothing: the indexer's top-k picks at each request's own candidate
count (``hip_kernels.indexer_topk``'s width), the attention's blocks after the last valid row
add exact zeros. Graphs are captured per batch size (the default), so no row is padded.
"""

import pytest
import torch

from dsv4 import Options
from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.model import DeepseekV4Model
from dsv4.random_init import init_random_weights
from reference_logits_fixtures import report

PROMPT_LENS = (252, 40, 124)     # decode crosses positions 255/256, -, 127/128
STEPS = 6


@pytest.fixture(scope="module")
def model():
    return init_random_weights(DeepseekV4Model(ModelConfig.preset("tiny"), max_seq_len=512),
                               seed=0)


@pytest.mark.parametrize("numerics", ["reference", "fp32"])
def test_graph_replay_gives_eager_tokens_and_logits(model, numerics):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    engines = {graph: Engine(model, max_batch=len(prompts), max_context_len=512,
                             options=Options(numerics=numerics, graph=graph))
               for graph in (False, True)}
    for n in range(1, len(prompts) + 1):
        want = engines[False].generate(prompts[:n], STEPS, return_logits=True)
        got = engines[True].generate(prompts[:n], STEPS, return_logits=True)
        assert engines[True].graph_runner.graph_batch_size(n) == n
        assert got.tokens == want.tokens
        assert torch.equal(got.logits, want.logits), report(got.logits, want.logits)
    assert engines[True].stats.graph_steps == len(prompts) * (STEPS - 1)
