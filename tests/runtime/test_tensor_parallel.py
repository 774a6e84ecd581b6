"""Tensor and expert parallelism on 2 and 4 gloo ranks (spawned processes, one spawn per world
size; the worker is tests/helpers/tp_worker.py): greedy tokens equal the one-rank run's for the
random tiny model, a saved bf16 checkpoint and a saved native (FP8/FP4) checkpoint, and logits
are within the engine's eager tolerance (the native checkpoint's at every step, in fp32
numerics, where only the split's summation order differs); an engine whose prefix cache agrees over the
ranks' group loads the same page on every rank and gives the one-rank tokens; each rank holds 1/N of the
sharded tensors plus the replicated ones; a rank killed mid-decode ends the other's
``generate --tp 2`` with one clear error line instead of a hang. The native (FP8/FP4) split is
checked in one process: the ranks' parts of each layer add up to the whole layer."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from dsv4.parallel import SINGLE, TensorSplit, split_problem
from dsv4.parallel.shards import expert_of, shard_dim
from dsv4.checkpoint import save_random_checkpoint

import tp_worker  # tests/helpers, on the path by tests/conftest.py
from spawn_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parents[1] / "helpers"

# The engine's eager-vs-graph tolerance (tests/runtime/test_runtime_graphs.py). Each rank's
# row-parallel partials stay fp32 until the sum; measured in fp32 numerics on the native
# checkpoint: 0.0005 (2 ranks), 0 (4); with bf16-rounded wo_b partials 0.19 to 5 and other tokens.
LOGIT_ATOL = 0.1
# The bf16 checkpoint in reference numerics: the CPU kernels' bf16 steps round by head count
# (tp_worker.FP32), measured 0.107 on the prefill (docs/parallel.md, Numerics).
BF16_CHECKPOINT_ATOL = 0.25


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_random_checkpoint(tp_worker.TINY_4, tmp_path_factory.mktemp("ckpt"), seed=8,
                                  quantize=False)


@pytest.fixture(scope="module")
def native_checkpoint(tmp_path_factory) -> Path:
    return save_random_checkpoint(tp_worker.NATIVE, tmp_path_factory.mktemp("native"), seed=8)


@pytest.fixture(scope="module")
def one_rank(checkpoint, native_checkpoint) -> dict:
    from dsv4.checkpoint import load_model

    tiny = {world: tp_worker.random_model(tp_worker.tiny_config(world), SINGLE)
            for world in (2, 4)}
    return {"tiny": {w: tp_worker.run(m) for w, m in tiny.items()},
            "cached": {w: tp_worker.cached_run(m, None) for w, m in tiny.items()},
            "checkpoint": tp_worker.run(load_model(checkpoint)),
            "native": tp_worker.run(load_model(native_checkpoint), tp_worker.FP32)}


def spawn(tmp_path: Path, world: int, checkpoint: Path, native: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HELPERS)])
    ranks = run_ranks(lambda rank: [str(HELPERS / "tp_worker.py"), str(rank), str(world),
                                    str(tmp_path / "init"), str(tmp_path), str(checkpoint),
                                    str(native)], world, 300, env)
    dies = {1: 9} if world == 2 else {}       # the rank the worker stops mid-decode
    failed = [(rank, log) for rank, (code, log) in enumerate(ranks)
              if code != dies.get(rank, 0)]
    assert not failed, "\n".join(f"rank {rank}:\n{log[-3000:]}" for rank, log in failed)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def expected_bytes(model_state: dict, world: int, n_experts: int) -> int:
    """One rank's bytes: the replicated tensors whole, 1/world of the sharded ones."""
    total = 0
    for name, t in model_state.items():
        size = t.numel() * t.element_size()
        total += size // world if shard_dim(name) is not None or expert_of(name) is not None \
            else size
    return total


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_generate_the_one_rank_tokens(tmp_path, world, checkpoint, native_checkpoint,
                                            one_rank):
    from dsv4.checkpoint import load_model

    results = spawn(tmp_path, world, checkpoint, native_checkpoint)
    wholes = {"tiny": tp_worker.random_model(tp_worker.tiny_config(world), SINGLE),
              "checkpoint": load_model(checkpoint), "native": load_model(native_checkpoint)}
    # (steps compared, bound): reference numerics' later steps, see docs/parallel.md, Numerics
    logit_checks = {"tiny": (slice(0, 1), LOGIT_ATOL),
                    "checkpoint": (slice(0, 1), BF16_CHECKPOINT_ATOL),
                    "native": (slice(None), LOGIT_ATOL)}
    for case, whole in wholes.items():
        want = one_rank[case][world] if case == "tiny" else one_rank[case]
        n_experts = whole.config.n_routed_experts
        steps, atol = logit_checks[case]
        for rank, got in enumerate(r[case] for r in results):
            assert got["tokens"] == want["tokens"], (case, rank)
            diff = (torch.tensor(got["logits"])[:, steps]
                    - torch.tensor(want["logits"])[:, steps]).abs().max()
            assert diff <= atol, (case, rank, float(diff))
            assert got["bytes"] == expected_bytes(whole.state_dict(), world, n_experts), \
                (case, rank)
    for rank, got in enumerate(r["cached"] for r in results):
        assert got == one_rank["cached"][world], rank
        assert got["hit_tokens"] == 128 and got["tokens"][0] == got["tokens"][1], rank
    if world == 2:
        cli = [json.loads((tmp_path / f"cli_rank{r}.json").read_text())
               for r in range(world) if (tmp_path / f"cli_rank{r}.json").exists()]
        assert len(cli) == 1, "rank 1 should have died before writing its record"
        lines = cli[0]["stderr"].strip().splitlines()
        assert cli[0]["status"] == 3 and len(lines) == 1, cli[0]
        assert "another tensor-parallel rank stopped" in lines[0], lines


def test_a_launch_and_a_split_are_checked_before_anything_runs():
    from dsv4.parallel import start_group

    cpu = torch.device("cpu")
    assert start_group(1, {}, cpu) is SINGLE                    # no torchrun: one process
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        start_group(2, {}, cpu)
    with pytest.raises(ValueError, match="WORLD_SIZE=4"):
        start_group(2, {"RANK": "0", "WORLD_SIZE": "4"}, cpu)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        TensorSplit(2, 2)
    with pytest.raises(ValueError, match="size"):
        TensorSplit(0, 0)


def test_a_torchrun_rank_on_a_cpu_joins_the_launchs_gloo_group(monkeypatch, flag_env):
    """`generate --tp 2` under torchrun, on a CPU: the rank joins with torchrun's RANK and
    WORLD_SIZE, on gloo, under the timeout that bounds every collective (the join is where
    this test stops the run)."""
    import datetime

    import torch.distributed as dist

    from dsv4.cli import main
    from dsv4.parallel.group import DEFAULT_TIMEOUT_S

    class Joined(Exception):
        pass

    joins = []

    def init_process_group(backend, **kwargs):
        joins.append((backend, kwargs))
        raise Joined

    flag_env()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(Joined):
        main(["generate", "--quiet", "--preset", "tiny", "--tp", "2", "--batch", "1",
              "--prompt-len", "2", "--max-new-tokens", "2"])
    assert joins == [("gloo", {"rank": 1, "world_size": 2,
                               "timeout": datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)})]


@pytest.mark.parametrize("world", [2, 4])
def test_the_main_commands_preset_splits_over_2_and_4_ranks(monkeypatch, flag_env, world):
    """The README's `torchrun --nproc-per-node N -m dsv4 generate --tp N` with the main
    command's own preset (small, published formats): every split count divides, each rank's
    model builds, and the command gets past its checks to the group join (where this test stops
    it)."""
    import torch.distributed as dist

    from dsv4.cli import main
    from dsv4.model import DeepseekV4Model

    small = tp_worker.ModelConfig.preset("small")
    assert split_problem(small, world, native=True) is None
    assert split_problem(small, world, native=False) is None
    rank = DeepseekV4Model(small, device="meta", weights="native",
                           split=TensorSplit(world - 1, world))
    assert rank.layers[0].attn.wo_b.weight.shape[1] == small.o_groups * small.o_lora_rank // world

    class Joined(Exception):
        pass

    def init_process_group(backend, **kwargs):
        raise Joined

    flag_env()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", str(world)), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(Joined):
        main(["generate", "--quiet", "--tp", str(world)])


def test_what_counts_as_a_stopped_peer():
    """A collective's error that means another rank stopped (gloo's closed connection, a
    timeout, NCCL's or RCCL's error) and not any other error."""
    import torch.distributed as dist

    from dsv4.parallel import is_peer_failure

    for text in ("[gloo] Connection closed by peer [10.0.0.2]:29500",
                 "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer",
                 "Timed out waiting 60000ms for recv operation to complete",
                 "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was "
                 "a network error"):
        assert is_peer_failure(RuntimeError(text)), text
    assert is_peer_failure(dist.DistBackendError("watchdog caught collective operation timeout"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("NCCL"))      # a user error, not a collective's

def test_a_split_that_does_not_divide_names_tp_and_the_shape():
    tiny = tp_worker.TINY
    assert split_problem(tiny, 2, native=False) is None
    problem = split_problem(tiny, 4, native=False)
    assert "--tp 4" in problem and "o_groups=2" in problem
    with pytest.raises(ValueError, match="o_groups=2"):
        from dsv4.model import DeepseekV4Model
        DeepseekV4Model(tiny, device="meta", split=TensorSplit(0, 4))
    # a native model's rank must hold whole 128-wide FP8 blocks of wo_b's inputs
    two_blocks = dataclasses.replace(tp_worker.ModelConfig.preset("small"), o_lora_rank=64)
    assert split_problem(two_blocks, 2, native=True) is None
    assert "o_groups*o_lora_rank/128=2" in split_problem(two_blocks, 4, native=True)
    assert split_problem(two_blocks, 4, native=False) is None


def test_native_ranks_parts_add_up_to_the_whole_layer(tmp_path, monkeypatch):
    """FP8/FP4 weights: each rank reads only its slices and experts; its q heads are the whole
    model's, its routed experts' sum is exact, and its wo_b partials are fp32 whose sum, rounded
    once, is the whole output up to the fp32 summation order (one bf16 ulp)."""
    import dsv4.layers.attention as attention
    import dsv4.layers.moe as moe
    import dsv4.weights.loader as loader
    from dsv4.options import Options
    from dsv4.checkpoint import load_model

    monkeypatch.setattr(moe, "sum_over_ranks", lambda y, split: y)     # added up here instead
    partials = []
    monkeypatch.setattr(attention, "sum_over_ranks", lambda y, split: partials.append(y) or y)
    two_layers = dataclasses.replace(tp_worker.NATIVE, n_layers=2, compress_ratios=(0, 4))
    path = save_random_checkpoint(two_layers, tmp_path, seed=8)     # a window and a CSA layer
    whole = load_model(path)
    reads = []
    read = loader._read
    monkeypatch.setattr(loader, "_read", lambda h, stored, part=None: reads.append(
        (stored.name, part)) or read(h, stored, part))
    parts = [load_model(path, split=TensorSplit(r, 2)) for r in range(2)]
    rank1 = reads[len(reads) // 2:]
    assert {expert_of(n) for n, _ in rank1} - {None} == set(range(4, 8))   # of 8 experts
    sliced = [(n, part) for n, part in rank1 if shard_dim(n) is not None
              or shard_dim(n.replace(".scale", ".weight")) is not None]
    assert sliced and all(part is not None and part[1] > 0 for _, part in sliced), sliced
    assert whole.weights == "native" and all(p.weights == "native" for p in parts)
    options = Options()
    x = torch.randn(5, whole.config.dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    ids = torch.arange(1, 6)
    for i, layer in enumerate(whole.layers):
        ffn = layer.ffn
        want = ffn.routed(x, *ffn.gate(x, ids, options), options.kernel)
        got = sum(p.layers[i].ffn.routed(x, *p.layers[i].ffn.local_routing(
            *p.layers[i].ffn.gate(x, ids, options)), options.kernel) for p in parts)
        assert torch.equal(got, want), i
        q = layer.attn.project_q(x)[0]
        assert torch.equal(torch.cat([p.layers[i].attn.project_q(x)[0] for p in parts], 1), q)
        o = q.float().tanh().bfloat16()
        freqs, pos = whole.layer_freqs(layer), torch.arange(5)
        want = layer.attn.project_out(o, freqs, pos)
        partials.clear()
        for r, p in enumerate(parts):
            p.layers[i].attn.project_out(o[:, 2 * r:2 * r + 2], freqs, pos)
        assert [t.dtype for t in partials] == [torch.float32] * 2
        got = (partials[0] + partials[1]).to(want.dtype)
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)   # one bf16 ulp
