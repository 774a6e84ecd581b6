"""Decode graphs vs eager decode, bit for bit, per batch size (tiny preset, random weights).

    python scripts/reference_oracle/graph_vs_eager.py [--steps 16] [--sizes pow2|every]

For each batch of 1..--max-batch prompts: eager decode, then the graph engine forced to eager's
tokens; per batch, how many (row, step) logits are bit-identical, the worst cosine, the argmax
flips and the largest difference. The first step of each row is the prefill (eager in both).
DSV4_NUMERICS and the other flags are read from the environment; --sizes sets
DSV4_GRAPH_BATCH_SIZES.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sizes", choices=("pow2", "every"), default="pow2")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--json", default=None, help="write the rows here too")
    a = ap.parse_args(argv)
    os.environ["DSV4_GRAPH_BATCH_SIZES"] = a.sizes
    from dsv4.config import ModelConfig
    from dsv4.engine import Engine
    from dsv4.model import DeepseekV4Model
    from dsv4.random_init import init_random_weights

    torch.set_num_threads(1)
    max_len = 192
    cfg = ModelConfig.preset("tiny")
    model = init_random_weights(DeepseekV4Model(cfg, max_seq_len=max_len), seed=1)
    eager = Engine(model, max_batch=a.max_batch, max_context_len=max_len, graph=False)
    graph = Engine(model, max_batch=a.max_batch, max_context_len=max_len, graph=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.vocab_size, (20 + 9 * i,), generator=g).tolist()
               for i in range(a.max_batch)]
    rows = []
    for n in range(1, a.max_batch + 1):
        want = eager.generate(prompts[:n], a.steps, return_logits=True)
        got = graph.generate(prompts[:n], a.steps, return_logits=True,
                             forced_tokens=want.tokens)
        w, x = want.logits, got.logits
        cos = torch.nn.functional.cosine_similarity(w.double(), x.double(), dim=-1)
        row = {"batch": n, "graph": graph.graph_runner.graph_batch_size(n),
               "row_steps": w.shape[0] * w.shape[1],
               "bit_identical": int((w == x).all(-1).sum()),
               "worst_cos": round(cos.min().item(), 5),
               "argmax_flips": int((w.argmax(-1) != x.argmax(-1)).sum()),
               "max_abs": round((w - x).abs().max().item(), 4)}
        rows.append(row)
        print(" ".join(f"{k} {v}" for k, v in row.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
