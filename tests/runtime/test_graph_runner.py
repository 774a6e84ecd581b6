"""GraphRunner on a toy decode step shaped like the DSV4 one: per-layer KV writes at SWA slots
obtained from an identity-keyed location cache, a window read through req_to_token -> full -> SWA,
padded rows on the dummy slot."""

import dataclasses
import functools
import re

import pytest
import torch

from dsv4.graphs import GraphCaptureError, GraphFlagChanged, GraphRunner, currently_capturing
from dsv4.graphs.backend import CUDA, EMULATE, select_backend
from dsv4.graphs.runner import capture_batch_sizes
from dsv4.options import Options
from hip_kernels.options import KernelOptions

SENTINEL = -7.0
N_LAYERS, DIM, WINDOW, MAX_LEN, N_REQS, VOCAB = 3, 4, 4, 16, 9, 50
INPUT_NAMES = ("input_ids", "positions", "seq_lens", "req_pool_indices", "out_cache_loc")
OPTIONS = Options(graph_batch_sizes="pow2")   # buckets with padded rows: what these tests test
BACKENDS = [pytest.param(EMULATE, id="emulate"),
            pytest.param(CUDA, id="cuda", marks=pytest.mark.gpu)]


class ToyPool:
    """The pool as the runner's step sees it. Request slot 0 and location 0 are the dummy;
    request r's token i lives at full location r * MAX_LEN + i."""

    def __init__(self, device):
        size_full = N_REQS * MAX_LEN
        perm = torch.randperm(size_full - 1, generator=torch.Generator().manual_seed(0)) + 1
        self.full_to_swa = torch.cat([torch.zeros(1, dtype=torch.long), perm,
                                      torch.tensor([-1])]).to(device)
        self.req_to_token = torch.arange(size_full, device=device).view(N_REQS, MAX_LEN)
        self.req_to_token[0] = 0
        self.kv = torch.full((N_LAYERS, size_full, DIM), SENTINEL, device=device)
        self.translations = 0
        self._loc_cache = {}

    def get_cached_swa_loc(self, loc):
        key = (loc.data_ptr(), loc.numel(), loc._version)
        if key not in self._loc_cache:
            self.translations += 1
            self._loc_cache[key] = (loc, self.full_to_swa[loc])
        return self._loc_cache[key][1]

    def invalidate_loc_cache(self):
        self._loc_cache.clear()

    def clone(self):
        other = ToyPool.__new__(ToyPool)
        other.full_to_swa, other.req_to_token = self.full_to_swa, self.req_to_token
        other.kv, other.translations, other._loc_cache = self.kv.clone(), 0, {}
        return other


class ToyWeights:
    def __init__(self, device):
        g = torch.Generator().manual_seed(1)
        self.embed = torch.randn(VOCAB, DIM, generator=g).to(device)
        self.scale = torch.randn(N_LAYERS, generator=g).to(device)
        self.head = torch.randn(DIM, DIM, generator=g).to(device)


def toy_step(pool, w, inp):
    x = w.embed[inp["input_ids"]] + inp["positions"].unsqueeze(1).float()
    pos = inp["seq_lens"].unsqueeze(1) - 1 - torch.arange(WINDOW, device=x.device)
    valid = (pos >= 0).unsqueeze(-1)
    window_slots = pool.full_to_swa[pool.req_to_token[inp["req_pool_indices"].unsqueeze(1),
                                                      pos.clamp(min=0)]]
    for layer in range(N_LAYERS):
        swa_loc = pool.get_cached_swa_loc(inp["out_cache_loc"])
        pool.kv[layer].index_copy_(0, swa_loc, x)
        ctx = torch.where(valid, pool.kv[layer][window_slots], 0.0).sum(1)
        x = x + w.scale[layer] * ctx
    return x @ w.head


def decode_batch(prompt_lens, step, device):
    """Live requests 1..n decoding their token at position prompt_len + step."""
    req = torch.arange(1, len(prompt_lens) + 1)
    pos = torch.tensor(prompt_lens) + step
    batch = {"input_ids": (req * 7 + pos) % VOCAB, "positions": pos, "seq_lens": pos + 1,
             "req_pool_indices": req, "out_cache_loc": req * MAX_LEN + pos}
    return {k: v.to(device) for k, v in batch.items()}


def prefill(pool, prompt_lens):
    g = torch.Generator().manual_seed(2)
    for r, n in enumerate(prompt_lens, start=1):
        slots = pool.full_to_swa[pool.req_to_token[r, :n]]
        pool.kv[:, slots] = torch.randn(N_LAYERS, n, DIM, generator=g).to(pool.kv.device)


def make_runner(pool, backend=EMULATE, max_batch=8, invalidate=True, step=None, **kwargs):
    device = pool.kv.device
    w = ToyWeights(device)
    return GraphRunner(
        step or (lambda inp: toy_step(pool, w, inp)),
        lambda n: {name: torch.zeros(n, dtype=torch.long, device=device) for name in INPUT_NAMES},
        max_batch, invalidate_fn=pool.invalidate_loc_cache if invalidate else (lambda: None),
        backend=backend, **{"options": OPTIONS, **kwargs})


def graph_vs_eager(prompt_lens, backend=EMULATE, steps=3, invalidate=True, device="cpu"):
    """Decode `steps` tokens with graphs and eagerly from the same state; returns both results."""
    pool = ToyPool(device)
    prefill(pool, prompt_lens)
    eager_pool, w = pool.clone(), ToyWeights(device)
    runner = make_runner(pool, backend, invalidate=invalidate)
    runner.capture()
    graph_out, eager_out = [], []
    for step in range(steps):
        batch = decode_batch(prompt_lens, step, device)
        graph_out.append(runner.replay(batch, OPTIONS).clone())
        eager_out.append(toy_step(eager_pool, w, batch))
    return torch.stack(graph_out), torch.stack(eager_out), pool, eager_pool


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt_lens", [[5], [3, 9, 1], [2, 4, 6, 8, 10], [1, 2, 3, 4, 5, 6, 7, 8]],
                         ids=["1", "3-padded-to-4", "5-padded-to-8", "8"])
def test_replay_matches_eager_decode(backend, prompt_lens):
    device = "cuda" if backend is CUDA else "cpu"
    graph_out, eager_out, pool, eager_pool = graph_vs_eager(prompt_lens, backend, device=device)
    torch.testing.assert_close(graph_out, eager_out)
    # slot 0 is the dummy that padded rows write; every other slot matches eager decode
    torch.testing.assert_close(pool.kv[:, 1:], eager_pool.kv[:, 1:])


def test_skipping_the_capture_invalidate_replays_stale_slots():
    """Proof that the check above can fail: without invalidation the warm-up's cached translation
    (of the padded static buffer: the dummy slot) is baked into every graph."""
    prompt_lens = [3, 9, 1]
    graph_out, eager_out, pool, eager_pool = graph_vs_eager(prompt_lens, invalidate=False)
    assert not torch.allclose(graph_out, eager_out)
    written = eager_pool.full_to_swa[decode_batch(prompt_lens, 0, "cpu")["out_cache_loc"]]
    assert (pool.kv[:, written] == SENTINEL).all()  # live KV never written...
    assert (eager_pool.kv[:, written] != SENTINEL).all()  # ...where eager decode wrote it


def slots_where(mask):
    return set(mask.any(-1).any(0).nonzero().flatten().tolist())


def test_padded_rows_write_only_the_dummy_slot():
    pool = ToyPool("cpu")
    runner = make_runner(pool, pad_values={"seq_lens": 1})
    runner.capture()
    first = decode_batch([2, 3, 4, 5], 0, "cpu")
    runner.replay(first, OPTIONS)  # graph 4, no padding
    after_first = pool.kv.clone()
    second = decode_batch([2, 3, 4], 1, "cpu")  # graph 4: row 3, which held request 4, is padding
    runner.replay(second, OPTIONS)
    live_first, live_second = (set(pool.full_to_swa[b["out_cache_loc"]].tolist())
                               for b in (first, second))
    assert live_second <= slots_where(pool.kv != after_first) <= live_second | {0}
    assert slots_where(pool.kv != SENTINEL) <= live_first | live_second | {0}
    assert runner.static["out_cache_loc"][3] == 0 and runner.static["req_pool_indices"][3] == 0
    assert runner.static["seq_lens"][3] == 1


def test_replay_picks_the_smallest_captured_graph():
    runner = make_runner(ToyPool("cpu"), max_batch=8)
    runner.capture()
    used = []
    for bs, g in runner.graphs.items():
        g.replay = functools.partial(lambda bs, original: (used.append(bs), original()),
                                     bs, g.replay)
    for n in range(1, 9):
        runner.replay(decode_batch(list(range(1, n + 1)), 0, "cpu"), OPTIONS)
    assert used == [1, 2, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="1..8"):
        runner.replay(decode_batch(list(range(1, 10)), 0, "cpu"), OPTIONS)


def test_capture_batch_sizes_are_bounded_by_max_batch():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(64) == capture_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_batch_sizes(6, "every") == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="which must be 'pow2' or 'every'"):
        capture_batch_sizes(6, "all")


def test_capture_runs_largest_first_invalidating_before_every_run():
    pool = ToyPool("cpu")
    w = ToyWeights("cpu")
    events = []
    pool.invalidate_loc_cache = lambda: (events.append("invalidate"), pool._loc_cache.clear())

    def step(inp):
        events.append((len(inp["input_ids"]), "capture" if currently_capturing() else "warm-up"))
        return toy_step(pool, w, inp)

    make_runner(pool, max_batch=4, step=step).capture()
    runs = [(bs, kind) for bs in (4, 2, 1) for kind in ("warm-up", "capture")]
    assert events == [e for run in runs for e in ("invalidate", run)]


def test_each_graph_records_one_swa_gather_for_all_layers():
    pool = ToyPool("cpu")
    runner = make_runner(pool)
    runner.capture()
    assert pool.translations == 2 * len(runner.batch_sizes)  # one per warm-up, one per capture
    loc_ptr = runner.static["out_cache_loc"].data_ptr()
    for g in runner.graphs.values():
        gathers = [op for op in g.ops if op.func is torch.ops.aten.index.Tensor
                   and op.args[0] is pool.full_to_swa and op.args[1][0].data_ptr() == loc_ptr]
        assert len(gathers) == 1


def test_host_sync_in_the_step_fails_capture_naming_the_op():
    pool = ToyPool("cpu")
    w = ToyWeights("cpu")

    def step(inp):
        if inp["seq_lens"].max().item() > MAX_LEN:
            raise ValueError("too long")
        return toy_step(pool, w, inp)

    with pytest.raises(GraphCaptureError, match="item"):
        make_runner(pool, step=step).capture()
    assert not currently_capturing()


def test_replaying_with_other_step_options_raises(flag_env):
    """The runner keeps the options it captured with; a replay for a step with other options
    (in a field that changes what a step computes) is refused, naming the field. The
    environment is read by nobody here: a flag changed after capture changes nothing."""
    runner = make_runner(ToyPool("cpu"))
    runner.capture()
    batch = decode_batch([1, 2], 0, "cpu")
    runner.replay(batch, OPTIONS)
    flag_env(DSV4_MULTI_STREAM_PREPARE="1", DSV4_NUMERICS="fp32")
    runner.replay(batch, OPTIONS)                                 # the flags: nothing
    runner.replay(batch, dataclasses.replace(OPTIONS, graph=False))   # not a step field
    runner.replay(batch, Options())                               # an equal value
    multi = dataclasses.replace(OPTIONS, multi_stream_prepare=True)
    with pytest.raises(GraphFlagChanged, match="multi_stream_prepare: False -> True"):
        runner.replay(batch, multi)
    fp32_torch = dataclasses.replace(OPTIONS, numerics="fp32",
                                     kernel=KernelOptions(backend="torch"))
    with pytest.raises(GraphFlagChanged, match="numerics: 'reference' -> 'fp32'.*kernel: "):
        runner.replay(batch, fp32_torch)
    runner.replay(batch, OPTIONS)                                 # back as captured


def test_capturing_twice_in_one_process():
    prompt_lens = [4, 2, 7]
    pool = ToyPool("cpu")
    eager_pool, w = pool.clone(), ToyWeights("cpu")
    runner = make_runner(pool)
    for step in range(2):
        runner.capture()
        batch = decode_batch(prompt_lens, step, "cpu")
        torch.testing.assert_close(runner.replay(batch, OPTIONS), toy_step(eager_pool, w, batch))
    second_out, second_eager, _, _ = graph_vs_eager([3, 3])  # another runner, another pool
    torch.testing.assert_close(second_out, second_eager)


def test_replay_rejects_a_malformed_batch():
    runner = make_runner(ToyPool("cpu"))
    batch = decode_batch([1, 2], 0, "cpu")
    with pytest.raises(RuntimeError, match="before capture"):
        runner.replay(batch, OPTIONS)
    runner.capture()
    with pytest.raises(KeyError, match="missing \\['seq_lens'\\]"):
        runner.replay({k: v for k, v in batch.items() if k != "seq_lens"}, OPTIONS)
    with pytest.raises(KeyError, match="unexpected \\['extra'\\]"):
        runner.replay({**batch, "extra": batch["seq_lens"]}, OPTIONS)
    with pytest.raises(ValueError, match=re.escape(
            "batch input 'positions' has shape (3,); expected (2, *())")):
        runner.replay({**batch, "positions": torch.zeros(3, dtype=torch.long)}, OPTIONS)
    # the first input fixes the row count; before it, the expected shape says "n rows"
    with pytest.raises(ValueError, match=re.escape(
            "batch input 'input_ids' has shape (2, 1); expected (n, *())")):
        runner.replay({**batch, "input_ids": batch["input_ids"][:, None]}, OPTIONS)
    with pytest.raises(ValueError, match="unknown inputs \\['lens'\\]"):
        make_runner(ToyPool("cpu"), pad_values={"lens": 1})


def test_backend_follows_the_flag(flag_env):
    flag_env(DSV4_GRAPH_BACKEND="emulate")
    assert select_backend(choice=Options.from_env().graph_backend) is EMULATE
    assert make_runner(ToyPool("cpu"), backend=None,
                       options=Options.from_env()).backend is EMULATE
    with pytest.raises(ValueError, match=r"choice='cpu': expected one of auto\|cuda\|emulate"):
        select_backend(choice="cpu")
    if torch.cuda.is_available():
        return
    flag_env(DSV4_GRAPH_BACKEND="auto")
    assert select_backend(choice=Options.from_env().graph_backend) is EMULATE
    flag_env(DSV4_GRAPH_BACKEND="cuda")
    with pytest.raises(RuntimeError, match="DSV4_GRAPH_BACKEND=cuda\\) needs a ROCm/CUDA GPU"):
        select_backend(choice=Options.from_env().graph_backend)


def test_auto_follows_the_steps_device(flag_env, monkeypatch):
    """auto picks by where the step runs: a CPU step takes the emulation even where a GPU
    exists (a CUDA graph of CPU work is empty and would replay nothing)."""
    flag_env(DSV4_GRAPH_BACKEND="auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_backend("cpu") is EMULATE
    assert select_backend(torch.device("cuda")) is CUDA
    assert select_backend() is CUDA
    runner = make_runner(ToyPool("cpu"), backend=None)      # chosen from its static inputs
    assert runner.backend is EMULATE
