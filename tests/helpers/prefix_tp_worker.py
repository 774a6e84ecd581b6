"""One tensor-parallel rank of the prefix agreement test (gloo, CPU).

    python prefix_tp_worker.py RANK WORLD INIT_FILE SCENARIOS_JSON OUT_DIR

Runs each scenario of SCENARIOS_JSON this rank takes part in (2-rank scenarios run on a group
of ranks 0 and 1, 4-rank ones on the whole world) and writes OUT_DIR/rank<RANK>.json.
"""

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from prefix_prefetch_sim import RankPrefix


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, scenarios, out = sys.argv[3], json.loads(Path(sys.argv[4]).read_text()), \
        Path(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=40))
    pair = dist.new_group([0, 1])
    results = {}
    for scenario in scenarios:
        if rank >= scenario["ranks"]:
            continue
        group = pair if scenario["ranks"] == 2 else dist.group.WORLD
        mine = scenario["per_rank"].get(str(rank), {})
        pages = scenario["pages"]
        prefix = RankPrefix(out / f"{scenario['name']}-rank{rank}", pages,
                            mine.get("host_pages", pages), mine.get("host_room", pages),
                            [tuple(c) for c in mine.get("corrupt", [])])
        results[scenario["name"]] = prefix.run(mine.get("arrive", pages), group)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
