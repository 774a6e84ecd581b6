"""One tensor-parallel rank running the engine with a prefix cache (gloo, CPU).

    python prefix_engine_tp_worker.py RANK WORLD INIT_FILE OUT_DIR FAULTS_JSON

Every rank builds the same model and engine. Pass 1 prefills a long prompt, filling the rank's
file tier (OUT_DIR/rank<R>/pages). The rank then restarts its cache (a fresh host tier over the
same directory) and applies its own fault from FAULTS_JSON {rank: fault}:

    "corrupt:<page>"   truncate that page's file (a torn write: a checksum miss)
    "delete:<page>"    remove that page's file (evicted by another process)
    "host-full"        a host tier of one page (promotions refused)
    "slow"             every page fetch sleeps 0.3 s (the others wait in the collective)

Pass 2 runs a prompt sharing most of that prefix, and the rank writes OUT_DIR/rank<R>.json: the
tokens committed from the cache, the agreement, the tokens and the largest logit difference
against the same engine without a cache, and whether every page and pin was given back.
"""

import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4.config import ModelConfig
from dsv4.engine import Engine
from dsv4.model import DeepseekV4Model
from dsv4.random_init import init_random_weights
from mem_pool.prefix import PrefixCache

CONFIG = dataclasses.replace(ModelConfig.preset("tiny"), window_size=256)
PAGE, WINDOW, STEPS = 128, 256, 3


def ids(n, seed):
    return torch.randint(2, CONFIG.vocab_size, (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def with_fault(cache: PrefixCache, fault: str, keys: list[str]) -> None:
    kind, _, page = fault.partition(":")
    if kind in ("corrupt", "delete"):
        path = cache.file.path_of(keys[int(page)])
        if kind == "corrupt":
            path.write_bytes(path.read_bytes()[:-64])
        else:
            path.unlink()
    elif kind == "slow":
        fetch = cache._fetch

        def slow_fetch(key, pinned):
            time.sleep(0.3)
            return fetch(key, pinned)
        cache._fetch = slow_fetch
    elif kind and kind != "host-full":      # host-full is the cache's capacity, set above
        raise ValueError(f"unknown fault {fault!r}")


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, out = sys.argv[3], Path(sys.argv[4])
    fault = json.loads(sys.argv[5]).get(str(rank), "")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    model = init_random_weights(DeepseekV4Model(CONFIG, max_seq_len=640), seed=3)
    base = ids(560, seed=11)
    earlier, later = base[:540], base[:520] + ids(20, seed=4)
    pages = out / f"rank{rank}" / "pages"

    def engine(cache):
        return Engine(model, page_size=PAGE, max_batch=2, max_context_len=640, graph=False,
                      prefix_cache=cache)

    group = dist.group.WORLD
    engine(PrefixCache(PAGE, WINDOW, 16, file_dir=pages, group=group)).generate([earlier], 1)
    cache = PrefixCache(PAGE, WINDOW, 1 if fault == "host-full" else 16, file_dir=pages,
                        group=group)
    with_fault(cache, fault, cache.keys(base))
    e = engine(cache)
    got = e.generate([later], STEPS, return_logits=True)
    want = engine(False).generate([later], STEPS, return_logits=True)
    a = e.allocator
    result = {
        "fault": fault,
        "hit_tokens": e.stats.prefix_hit_tokens,
        "file_page_hits": cache.stats.file_page_hits,
        "short_prefetches": cache.stats.short_prefetches,
        "tokens": got.tokens[0], "tokens_without_cache": want.tokens[0],
        "logit_diff": float((got.logits - want.logits).abs().max()),
        "pages_given_back": a.full_available_size() == a.size_full
        and a.swa_available_size() == a.size_swa,
        "pins": cache.host.pinned_pages(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
