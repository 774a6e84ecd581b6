"""DSV4_NUMERICS=reference (the default): teacher-forced eager decode gives, bit for bit, the
logits of DeepSeek-V4's reference inference code, stored in tests/data by
scripts/reference_oracle/make_fixture.py (the reference itself is not in this repository), one
fixture per CPU kernel set (scripts/reference_oracle/cpu_kernel_set.py: torch's vector kernels,
the CPU vendor MKL dispatches by, the kernels of bf16 matmuls; each sums in its own order, in the
reference as here: its own logits differ between two AMD CPUs, AVX2 and AVX512, on 63 of 200
steps, and between the AMD AVX512 one and an Intel Xeon with AMX on all 200);
and decode graphs give eager's bits whenever no padded batch changes a GEMM's row count and no
tie at the indexer's k-th place is picked differently over the graph's candidate count.

What holds in each mode:
- reference: eager decode equals the reference for the same batch, bit for bit (here batch 1);
  a graph replay equals eager for a captured batch size; a request's logits depend on the batch
  it shares (as the reference's do): a padded graph batch, or other batch mates, change the
  row count of the fp32 compressor GEMMs, whose CPU/GPU kernels sum in another order for
  another row count, and the picks of the indexer's top-k among tied bf16 scores.
- fp32: stable across batch compositions within the tolerances of the runtime tests (which run
  in that mode); not bit-exact with the reference (checked here, so the fixture tells the modes
  apart).

The fixture's prompt is one token: there is no prefill to chunk here (a prefill of its first
tokens would compare an extend with the reference's decode steps). Chunked prefill is held to
the reference's bits on the FP8 fixture's prompts (test_numerics_reference_fp8.py) and, with
bf16 weights, to one extend's bits (tests/runtime/test_chunked_prefill.py).
"""

import pytest
import torch
from safetensors import safe_open

from dsv4.checkpoint import load_model, save_random_checkpoint
from dsv4.config import ModelConfig
from dsv4.engine import Engine
from reference_logits_fixtures import (DATA, checkpoint_digest, fixture_for_here,
                                       skip_unless_fixture_here, fixture_meta, kernel_label, report)

FIXTURES = sorted(DATA.glob("reference_logits_tiny_*.safetensors"))


def read_fixture():
    """(logits, tokens, metadata) of this machine's fixture, else of the first: every fixture
    holds the same tokens and checkpoint; only the logits' last bits differ."""
    with safe_open(str(fixture_for_here(FIXTURES) or FIXTURES[0]), framework="pt") as f:
        return f.get_tensor("logits"), f.get_tensor("tokens").tolist(), f.metadata()


def test_the_fixtures_share_tokens_and_checkpoint():
    assert len(FIXTURES) >= 2
    metas = [fixture_meta(p) for p in FIXTURES]
    for key in ("checkpoint_digest", "checkpoint_seed", "tokens", "reference_model_py_sha256"):
        assert len({m[key] for m in metas}) == 1, key
    for p, m in zip(FIXTURES, metas):
        assert p.stem.endswith("_" + kernel_label(p)), p.name


@pytest.fixture(scope="module")
def fixture_model(tmp_path_factory):
    """(model loaded from the regenerated checkpoint, reference logits, token ids)."""
    logits, tokens, meta = read_fixture()
    path = save_random_checkpoint(ModelConfig.preset(meta["preset"]),
                                  tmp_path_factory.mktemp("ckpt"),
                                  seed=int(meta["checkpoint_seed"]), quantize=False)
    assert checkpoint_digest(path) == meta["checkpoint_digest"], (
        "the random checkpoint is no longer the one the fixture was made from: rerun "
        "scripts/reference_oracle/make_fixture.py")
    return load_model(path), logits, tokens


def teacher_forced(model, tokens):
    """Logits [len(tokens), vocab] of eager decode: prefill tokens[0], then force each next."""
    ctx = max(512, -(-(len(tokens) + 1) // 128) * 128)
    engine = Engine(model, max_batch=1, max_context_len=ctx, page_size=128, graph=False)
    out = engine.generate([tokens[:1]], len(tokens), return_logits=True,
                          forced_tokens=[tokens[1:] + [tokens[0]]])
    return out.logits[0]


def test_eager_decode_gives_the_reference_logits_bit_for_bit(fixture_model, flag_env):
    """The reference ran on a CPU with torch's kernels for that CPU (its GEMMs, reductions and
    bf16 rsqrt pick their summation order and rounding by instruction set and vendor): the same
    bits are expected from the same torch version and CPU kernel set, which the fixture
    records."""
    skip_unless_fixture_here(FIXTURES, "scripts/reference_oracle/make_fixture.py")
    flag_env()   # default flags
    model, want, tokens = fixture_model
    got = teacher_forced(model, tokens)
    assert got.shape == want.shape
    assert torch.equal(got, want), report(got, want)


def test_fp32_numerics_are_close_to_the_reference_but_not_its_bits(fixture_model, flag_env):
    """Measured on this fixture: mean cosine ~0.997, most steps not bit-identical."""
    flag_env(DSV4_NUMERICS="fp32")
    model, want, tokens = fixture_model
    got = teacher_forced(model, tokens)
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert cos.mean() > 0.99, report(got, want)
    assert (got != want).any(-1).float().mean() > 0.5, report(got, want)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (20 + 9 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("sizes, n", [("pow2", 2), ("pow2", 4), ("every", 3)])
def test_a_replayed_graph_gives_eager_bits_when_nothing_is_padded(fixture_model, flag_env,
                                                                   sizes, n):
    """Captured batch sizes (the default pow2 buckets, or DSV4_GRAPH_BATCH_SIZES=every): replay
    gives eager decode's logits bit for bit. (A batch of 3 on pow2 replays the graph of 4; its
    padded row changes the fp32 compressor GEMMs' row count, and with it live rows' bits.)"""
    flag_env(DSV4_GRAPH_BATCH_SIZES=sizes)
    model = fixture_model[0]
    steps = 6
    eager = Engine(model, max_batch=4, max_context_len=256, graph=False)
    graph = Engine(model, max_batch=4, max_context_len=256, graph=True)
    want = eager.generate(prompts(n), steps, return_logits=True)
    got = graph.generate(prompts(n), steps, return_logits=True, forced_tokens=want.tokens)
    assert graph.stats.graph_steps == steps - 1
    assert n in graph.graph_runner.batch_sizes
    assert torch.equal(got.logits, want.logits), report(got.logits.flatten(0, 1),
                                                        want.logits.flatten(0, 1))
