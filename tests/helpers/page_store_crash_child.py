"""A writer process for the FilePageStore crash test.

    python page_store_crash_child.py DIRECTORY HANG_AT

puts pages page000, page001, ... (records from `numbered_record`) into a FilePageStore on
DIRECTORY, printing "DONE <key>" after each. With HANG_AT >= 0, the put of page number HANG_AT
stops after its temporary file is written and fsynced, just before the rename: it prints
"HANG <temporary path>" and sleeps, for the test to kill it there. With HANG_AT < 0 it writes
until killed.
"""

import os
import sys
import time

import torch


def numbered_record(i: int) -> dict[str, torch.Tensor]:
    """A page record whose bytes depend on i (a few hundred bytes)."""
    g = torch.Generator().manual_seed(1000 + i)
    return {"kv/swa/mask": torch.rand(8, generator=g) < 0.5,
            "kv/swa/0/values": torch.randint(0, 256, (8, 24), generator=g, dtype=torch.uint8),
            "kv/swa/0/scales": torch.randint(0, 256, (8, 4), generator=g, dtype=torch.uint8),
            "state/compressor_state/1": torch.randn(2, 6, generator=g)}


def key_of(i: int) -> str:
    return f"page{i:03d}"


def main() -> None:
    from mem_pool import FilePageStore

    directory, hang_at = sys.argv[1], int(sys.argv[2])
    store = FilePageStore(directory)
    real_replace = os.replace
    current = {"i": -1}

    def replace_or_hang(src, dst):
        if current["i"] == hang_at:
            print("HANG", src, flush=True)
            time.sleep(120)
        real_replace(src, dst)

    os.replace = replace_or_hang
    for i in range(10_000):
        current["i"] = i
        store.put(key_of(i), numbered_record(i))
        print("DONE", key_of(i), flush=True)


if __name__ == "__main__":
    main()
