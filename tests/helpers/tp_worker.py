"""One tensor-parallel rank of tests/runtime/test_tensor_parallel.py (gloo, CPU).

    python tp_worker.py RANK WORLD INIT_FILE OUT_DIR CHECKPOINT_DIR NATIVE_CHECKPOINT_DIR

The rank builds its part of the random tiny model, of a saved bf16 checkpoint and of a saved
native (FP8/FP4) checkpoint, generates greedily with each (``run``, which the test also calls on
one rank; the native one in fp32 numerics, see ``FP32``), and writes
OUT_DIR/rank<R>.json: tokens, logits, the bytes of its tensors, and the tokens and prefix-cache
hits of a prompt run twice through an engine whose prefix cache agrees over the ranks' group
(``cached_run``). On 2 ranks, rank 1 then stops
dead in the third decode step of ``python -m dsv4 generate --tp 2`` and rank 0 records how its
own run of the command ended (OUT_DIR/cli_rank0.json).
"""

import dataclasses
import datetime
import io
import json
import os
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.model import DeepseekV4Model
from dsv4.options import Options
from dsv4.parallel import TensorSplit
from dsv4.random_init import init_random_weights
from mem_pool.prefix import PrefixCache
from dsv4.checkpoint import load_model

TINY = ModelConfig.preset("tiny")
# the tiny preset has o_groups=2: 4 ranks need 4 output groups
TINY_4 = dataclasses.replace(TINY, o_groups=4)
# the small (native) preset: 4 groups of rank 128, so wo_b's 512 inputs split in 128-wide blocks
NATIVE = ModelConfig.preset("small")
PROMPTS = [[5, 17, 300, 42, 9, 77, 101, 3], [250, 11, 60]]
NEW_TOKENS = 3
# The reference numerics' bf16 steps run through CPU kernels whose last bit depends on the head
# count (torch's bf16 rsqrt of the q norm, the attention's einsums), so a rank's heads round
# unlike the whole model's; fp32 numerics leave only the split's own summation order.
FP32 = Options(numerics="fp32")


def tiny_config(world: int) -> ModelConfig:
    return TINY if world <= 2 else TINY_4


def tensor_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def run(model, options: Options | None = None) -> dict:
    out = Engine(model, max_batch=2, max_context_len=64, graph=False, options=options).generate(
        PROMPTS, NEW_TOKENS, return_logits=True)
    return {"tokens": out.tokens, "logits": out.logits.tolist(), "bytes": tensor_bytes(model)}


def cached_run(model, group) -> dict:
    """A 200-token prompt twice in one engine with a prefix cache: the second pass loads its
    first page (128 tokens) from the cache."""
    prompt = [(7 * i) % 500 + 2 for i in range(200)]
    cache = PrefixCache(128, model.config.window_size, 8, group=group)
    engine = Engine(model, page_size=128, max_batch=1, max_context_len=256, graph=False,
                    prefix_cache=cache)
    runs = [engine.generate([prompt], 2).tokens[0] for _ in range(2)]
    return {"tokens": runs, "hit_tokens": engine.stats.prefix_hit_tokens}


def random_model(config, split: TensorSplit):
    return init_random_weights(DeepseekV4Model(config, max_seq_len=256, split=split), seed=5)


def kill_mid_decode(rank: int, out: Path) -> None:
    """Rank 1 dies in its third decode step; rank 0 records how the command ended."""
    from dsv4 import cli

    if rank == 1:
        step = Engine._decode_step
        calls = []

        def dying_step(self, *args):
            calls.append(1)
            if len(calls) == 3:
                os._exit(9)
            return step(self, *args)
        Engine._decode_step = dying_step
    err = io.StringIO()
    start = time.perf_counter()
    with redirect_stderr(err):
        status = cli.main(["generate", "--preset", "tiny", "--tp", "2", "--quiet", "--batch", "1",
                           "--prompt-len", "8", "--max-new-tokens", "40", "--no-graph"])
    (out / f"cli_rank{rank}.json").write_text(json.dumps(
        {"status": status, "stderr": err.getvalue(),
         "seconds": time.perf_counter() - start}))
    os._exit(0)            # the group lost a rank: nothing to tear down


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, out, checkpoint, native = sys.argv[3], Path(sys.argv[4]), sys.argv[5], sys.argv[6]
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    split = TensorSplit(rank, world, dist.group.WORLD)
    tiny = random_model(tiny_config(world), split)
    result = {"tiny": run(tiny), "cached": cached_run(tiny, split.group),
              "checkpoint": run(load_model(checkpoint, split=split)),
              "native": run(load_model(native, split=split), FP32)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    if world == 2:
        kill_mid_decode(rank, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
