"""One tensor-parallel rank running the engine with a prefix cache (gloo, CPU).

    python prefix_engine_tp_worker.py RANK WORLD INIT_FILE OUT_DIR PAGES_DIR SCENARIOS_JSON

Every rank builds the same model (``model()``). PAGES_DIR holds the file tier that pass 1
(``fill_pages``, run once by the test) left: the pages of ``EARLIER``. SCENARIOS_JSON is a list
of {"name", "ranks", "faults": {rank: fault}}; a 2-rank scenario runs on a group of ranks 0 and
1, a scenario of every rank on the whole world, one after another in one process group. For each
scenario it takes part in, the rank copies PAGES_DIR into its own file tier
(OUT_DIR/<name>/rank<R>/pages), opens a fresh cache over it, applies its own fault:

    "corrupt:<page>"   truncate that page's file (a torn write: a checksum miss)
    "delete:<page>"    remove that page's file (evicted by another process)
    "host-full"        a host tier of one page (promotions refused)
    "slow"             every page fetch sleeps 0.3 s (the others wait in the collective)

and runs ``LATER``, a prompt sharing most of that prefix. It writes OUT_DIR/rank<R>.json,
{scenario: result}: the tokens committed from the cache, the tokens and logits generated, and
whether every page and pin was given back. The test sets them against ``without_cache``.
"""

import dataclasses
import datetime
import json
import shutil
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
PAGE, WINDOW, STEPS, MAX_LEN = 128, 256, 3, 640


def ids(n, seed):
    return torch.randint(2, CONFIG.vocab_size, (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


BASE = ids(560, seed=11)
EARLIER, LATER = BASE[:540], BASE[:520] + ids(20, seed=4)


def model() -> DeepseekV4Model:
    return init_random_weights(DeepseekV4Model(CONFIG, max_seq_len=MAX_LEN), seed=3)


def engine(m: DeepseekV4Model, cache) -> Engine:
    return Engine(m, page_size=PAGE, max_batch=2, max_context_len=MAX_LEN, graph=False,
                  prefix_cache=cache)


def fill_pages(m: DeepseekV4Model, pages: Path) -> None:
    """Pass 1: prefill EARLIER, leaving its pages in the file tier at `pages`."""
    engine(m, PrefixCache(PAGE, WINDOW, 16, file_dir=pages)).generate([EARLIER], 1)


def without_cache(m: DeepseekV4Model):
    """LATER on an engine with no cache: what every rank's cached run must give."""
    return engine(m, False).generate([LATER], STEPS, return_logits=True)


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
    elif kind and kind != "host-full":      # host-full is the cache's capacity, set below
        raise ValueError(f"unknown fault {fault!r}")


def run_scenario(m: DeepseekV4Model, fault: str, template: Path, pages: Path, group) -> dict:
    shutil.copytree(template, pages)
    cache = PrefixCache(PAGE, WINDOW, 1 if fault == "host-full" else 16, file_dir=pages,
                        group=group)
    with_fault(cache, fault, cache.keys(BASE))
    e = engine(m, cache)
    got = e.generate([LATER], STEPS, return_logits=True)
    a = e.allocator
    return {
        "fault": fault,
        "hit_tokens": e.stats.prefix_hit_tokens,
        "file_page_hits": cache.stats.file_page_hits,
        "short_prefetches": cache.stats.short_prefetches,
        "tokens": got.tokens[0], "logits": got.logits.tolist(),
        "pages_given_back": a.full_available_size() == a.size_full
        and a.swa_available_size() == a.size_swa,
        "pins": cache.host.pinned_pages(),
    }


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, out, template = sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
    scenarios = json.loads(sys.argv[6])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    pair = dist.new_group([0, 1])
    m = model()
    results = {}
    for s in scenarios:
        if rank < s["ranks"]:
            group = dist.group.WORLD if s["ranks"] == world else pair
            results[s["name"]] = run_scenario(m, s["faults"].get(str(rank), ""), template,
                                              out / s["name"] / f"rank{rank}" / "pages", group)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
