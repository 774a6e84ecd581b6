"""Decode graphs vs eager decode, bit for bit, per batch size (tiny preset, random weights).

    python scripts/reference_oracle/graph_vs_eager.py [--steps 16] [--max-batch 4] \
        [--numerics reference fp32] [--prompts short crossing long] [--sizes every|pow2]

For each numerics mode, prompt set and batch of 1..--max-batch prompts: eager decode, then the
graph engine (the CPU emulation of graphs on a CPU) forced to eager's tokens; per batch, the
graph size it replays, how many (row, step) logits are bit-identical, whether the greedy tokens
are eager's when the graph engine samples them itself, the worst cosine and the largest
difference. The first step of each row is the prefill (eager in both). Prompt sets (lengths
differ within a batch): short, 20 + 9 i tokens (under the 128-token window); crossing, 118 + 3 i
(the decode crosses the window and the first 128-token compressed block); long, 250 + 9 i (past
the window, crossing the second 128-token block). The other DSV4_* flags are read from the
environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

PROMPT_SETS = {"short": (20, 9), "crossing": (118, 3), "long": (250, 9)}


def prompts(which: str, n: int, vocab: int) -> list[list[int]]:
    first, step = PROMPT_SETS[which]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (first + step * i,), generator=g).tolist() for i in range(n)]


def compare(model, numerics: str, which: str, max_batch: int, steps: int, sizes: str,
            max_len: int) -> list[dict]:
    from dsv4 import Options
    from dsv4.engine import Engine

    env = Options.from_env()
    eager = Engine(model, max_batch=max_batch, max_context_len=max_len,
                   options=dataclasses.replace(env, numerics=numerics, graph=False))
    graph = Engine(model, max_batch=max_batch, max_context_len=max_len,
                   options=dataclasses.replace(env, numerics=numerics, graph=True,
                                               graph_batch_sizes=sizes))
    rows = []
    for n in range(1, max_batch + 1):
        batch = prompts(which, n, model.config.vocab_size)
        want = eager.generate(batch, steps, return_logits=True)
        got = graph.generate(batch, steps, return_logits=True, forced_tokens=want.tokens)
        sampled = graph.generate(batch, steps)
        w, x = want.logits, got.logits
        cos = torch.nn.functional.cosine_similarity(w.double(), x.double(), dim=-1)
        row = {"numerics": numerics, "prompts": which, "batch": n,
               "graph": graph.graph_runner.graph_batch_size(n),
               "row_steps": w.shape[0] * w.shape[1],
               "bit_identical": int((w == x).all(-1).sum()),
               "same_tokens": sampled.tokens == want.tokens,
               "worst_cos": round(cos.min().item(), 5),
               "max_abs": round((w - x).abs().max().item(), 4)}
        rows.append(row)
        print(" ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--numerics", nargs="+", default=["reference", "fp32"],
                    choices=("reference", "fp32"))
    ap.add_argument("--prompts", nargs="+", default=list(PROMPT_SETS), choices=list(PROMPT_SETS))
    ap.add_argument("--sizes", choices=("pow2", "every"), default="every",
                    help="the graphs' batch sizes (DSV4_GRAPH_BATCH_SIZES)")
    ap.add_argument("--json", default=None, help="write the rows here too")
    a = ap.parse_args(argv)
    from dsv4.config import ModelConfig
    from dsv4.model import DeepseekV4Model
    from dsv4.random_init import init_random_weights

    torch.set_num_threads(1)
    max_len = 512
    model = init_random_weights(DeepseekV4Model(ModelConfig.preset("tiny"), max_seq_len=max_len),
                                seed=1)
    rows = [row for numerics in a.numerics for which in a.prompts
            for row in compare(model, numerics, which, a.max_batch, a.steps, a.sizes, max_len)]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
