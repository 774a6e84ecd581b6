"""Start one Python process per rank and wait for all of them (the multi-rank tests' launcher).

``run_ranks(argv_of_rank, world, timeout, env)`` starts ``python *argv_of_rank(rank)`` for each
rank with stdout and stderr merged, waits for every one (each up to ``timeout`` seconds), kills
any left running, and returns each rank's (return code, log)."""

from __future__ import annotations

import subprocess
import sys
from typing import Callable


def run_ranks(argv_of_rank: Callable[[int], list[str]], world: int, timeout: float,
              env: dict[str, str]) -> list[tuple[int, str]]:
    procs = [subprocess.Popen([sys.executable, *argv_of_rank(rank)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(world)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    return [(proc.returncode, log) for proc, log in zip(procs, logs)]
