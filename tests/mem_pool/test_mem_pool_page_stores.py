"""The host and file tiers of the prefix cache: LRU, pins and free counts; byte-exact files;
corrupt, truncated and torn files are misses; a writer killed mid-way loses only its last page."""

import logging
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
from page_store_crash_child import key_of, numbered_record

from mem_pool import FilePageStore, HostPageStore

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parents[1] / "helpers" / "page_store_crash_child.py"
HEADER = 8 + 4 + 8 + 32          # magic, version, payload length, sha256 (the documented layout)


def same_record(a, b):
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
                                    for k in a)


# ---- host tier ------------------------------------------------------------------------------

def test_host_store_lru_eviction_and_free_counts():
    evicted = []
    store = HostPageStore(3, on_evict=lambda key, record: evicted.append(key))
    for i in range(3):
        assert store.put(key_of(i), numbered_record(i))
    assert (store.used_pages(), store.free_pages()) == (3, 0)
    assert same_record(store.get(key_of(0)), numbered_record(0))   # page 0 is now the newest
    assert store.put(key_of(3), numbered_record(3))
    assert evicted == [key_of(1)]                                   # the least recently used
    assert [store.contains(key_of(i)) for i in range(4)] == [True, False, True, True]
    assert store.contains(key_of(2))                                # contains is not a use
    assert store.put(key_of(4), numbered_record(4))
    assert evicted == [key_of(1), key_of(2)]
    assert store.get(key_of(1)) is None
    for key in store.keys():
        assert store.evict(key)
    assert (store.used_pages(), store.free_pages()) == (0, 3)
    assert not store.evict(key_of(0))


def test_host_store_never_evicts_a_pinned_page():
    store = HostPageStore(2)
    store.put("a", numbered_record(0))
    store.put("b", numbered_record(1))
    store.pin("a")
    store.pin("b")
    store.pin("b")                                                 # pins are counted
    assert not store.put("c", numbered_record(2))                  # all pinned: refused
    assert store.keys() == ["a", "b"] and store.free_pages() == 0
    store.unpin("b")
    assert store.pinned_pages() == 2 and not store.put("c", numbered_record(2))   # b: one left
    store.unpin("b")
    assert store.put("c", numbered_record(2))                      # b was the only unpinned
    assert store.keys() == ["a", "c"]
    with pytest.raises(ValueError, match="pinned"):
        store.evict("a")
    store.unpin("a")
    assert store.pinned_pages() == 0 and store.evict("a")
    with pytest.raises(KeyError):
        store.pin("zz")
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin("c")
    assert store.put("c", numbered_record(9))                      # replacing needs no room
    assert same_record(store.get("c"), numbered_record(9)) and store.used_pages() == 1


@pytest.mark.parametrize("capacity", [0, -1, True, 1.5])
def test_host_store_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError):
        HostPageStore(capacity)


# ---- file tier ------------------------------------------------------------------------------

def test_file_store_round_trip_is_byte_exact_and_survives_reopen(tmp_path):
    store = FilePageStore(tmp_path)
    for i in range(3):
        store.put(key_of(i), numbered_record(i))
    reopened = FilePageStore(tmp_path)
    assert sorted(reopened.keys()) == [key_of(i) for i in range(3)]
    for i in range(3):
        assert same_record(reopened.get(key_of(i)), numbered_record(i))
    data = reopened.path_of(key_of(1)).read_bytes()
    magic, version, length = struct.unpack_from("<8sIQ", data)
    assert magic == b"DSV4PAGE" and version == 1 and length == len(data) - HEADER
    assert same_record(safetensors.torch.load(data[HEADER:]), numbered_record(1))
    assert reopened.get("absent") is None
    assert reopened.free_pages() is None and reopened.used_pages() == 3


def test_file_store_capacity_evicts_least_recently_used(tmp_path):
    store = FilePageStore(tmp_path, capacity_pages=2)
    store.put("a", numbered_record(0))
    store.put("b", numbered_record(1))
    assert store.get("a") is not None
    store.put("c", numbered_record(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.page", "c.page"]
    assert store.free_pages() == 0
    assert store.evict("a") and store.evict("c") and not store.evict("c")
    assert store.free_pages() == 2 and not list(tmp_path.iterdir())


def test_reopening_with_a_smaller_capacity_keeps_the_newest_files(tmp_path):
    """Pages on disk at open are ordered by modification time: the oldest go first."""
    store = FilePageStore(tmp_path)
    for i, key in enumerate("abc"):
        store.put(key, numbered_record(i))
    for age, key in enumerate("bac"):                     # b newest, c oldest: not put order
        os.utime(store.path_of(key), (1_000_000 - age * 100, 1_000_000 - age * 100))
    reopened = FilePageStore(tmp_path, capacity_pages=2)
    assert reopened.keys() == ["a", "b"] and reopened.free_pages() == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.page", "b.page"]
    smallest = FilePageStore(tmp_path, capacity_pages=1)
    assert smallest.keys() == ["b"] and [p.name for p in tmp_path.iterdir()] == ["b.page"]
    assert same_record(smallest.get("b"), numbered_record(1))


def corrupt_cases():
    def flip_payload_byte(data):
        return data[:-5] + bytes([data[-5] ^ 0x01]) + data[-4:]

    def flip_header_checksum(data):
        return data[:HEADER - 1] + bytes([data[HEADER - 1] ^ 0x80]) + data[HEADER:]

    return {"flipped payload byte": flip_payload_byte,
            "flipped checksum byte": flip_header_checksum,
            "truncated payload": lambda data: data[:len(data) - 10],
            "truncated header": lambda data: data[:HEADER - 3],
            "empty file": lambda data: b"",
            "bad magic": lambda data: b"XSV4PAGE" + data[8:],
            "newer version": lambda data: data[:8] + struct.pack("<I", 2) + data[12:],
            "extra bytes": lambda data: data + b"\0"}


@pytest.mark.parametrize("damage", corrupt_cases().values(), ids=corrupt_cases().keys())
def test_a_damaged_file_is_a_logged_miss_and_is_removed(tmp_path, caplog, damage):
    store = FilePageStore(tmp_path)
    store.put("good", numbered_record(0))
    store.put("bad", numbered_record(1))
    path = store.path_of("bad")
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="mem_pool"):
        assert store.get("bad") is None
        assert store.get("bad") is None and not store.contains("bad")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert not path.exists()
    assert same_record(store.get("good"), numbered_record(0))
    assert store.used_pages() == 1


@pytest.mark.parametrize("meanwhile, warnings", [
    ("removed", ["is unusable"]),                    # another process got there first: fine
    ("not removable", ["is unusable", "could not remove unusable page file"]),
])
def test_a_damaged_file_that_cannot_be_removed_is_still_a_miss(tmp_path, caplog, monkeypatch,
                                                               meanwhile, warnings):
    """Between reading a damaged file and removing it, another process sharing the directory
    may have removed it (no second warning), or the file may resist removal (said once more);
    either way the page is a miss and the store forgets it."""
    import mem_pool.prefix.file_page_store as fps

    store = FilePageStore(tmp_path)
    store.put("bad", numbered_record(1))
    path = store.path_of("bad")
    path.write_bytes(path.read_bytes()[:-1])
    read_payload = fps.page_file_payload

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied")

    def payload_then(data):
        if meanwhile == "removed":
            path.unlink()
        else:
            monkeypatch.setattr(fps.Path, "unlink", refuse)
        return read_payload(data)

    monkeypatch.setattr(fps, "page_file_payload", payload_then)
    with caplog.at_level(logging.WARNING, logger="mem_pool"):
        assert store.get("bad") is None
    got = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(got) == len(warnings) and all(w in g for w, g in zip(warnings, got)), got
    assert not store.contains("bad") and store.used_pages() == 0


def test_temporary_files_are_never_read_and_are_cleaned_at_open(tmp_path):
    writer = FilePageStore(tmp_path)
    writer.put("a", numbered_record(0))
    leftover = tmp_path / ".b.x1y2z3.tmp"
    leftover.write_bytes(writer.path_of("a").read_bytes())         # a whole, valid page
    assert writer.get("b") is None
    reopened = FilePageStore(tmp_path)
    assert not leftover.exists() and reopened.keys() == ["a"]


@pytest.mark.parametrize("key", ["", "../up", "a/b", "a.page", "k" * 129, 7])
def test_keys_must_be_safe_file_names(tmp_path, key):
    with pytest.raises(ValueError):
        FilePageStore(tmp_path).put(key, numbered_record(0))


# ---- crash safety ---------------------------------------------------------------------------

def run_child_until(directory: Path, hang_at: int, stop_line: str, limit_s: float = 60):
    """Start the writer, read its lines until one starts with stop_line, SIGKILL it; returns
    the lines. A watchdog kills it after limit_s so a stuck child fails the test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(CHILD.parent)]),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(CHILD), str(directory), str(hang_at)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(limit_s, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.split())
            if line.startswith(stop_line):
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        watchdog.cancel()
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert lines and lines[-1][0] == stop_line.split()[0], f"child output {lines}: {err}"
    assert proc.returncode == -signal.SIGKILL
    return lines


def test_writer_killed_before_the_rename_loses_only_that_page(tmp_path):
    lines = run_child_until(tmp_path, hang_at=5, stop_line="HANG")
    assert [line[1] for line in lines[:-1]] == [key_of(i) for i in range(5)]
    temp = Path(lines[-1][1])
    assert temp.exists() and temp.parent == tmp_path       # written and fsynced, not renamed
    assert not (tmp_path / f"{key_of(5)}.page").exists()
    store = FilePageStore(tmp_path)
    assert not temp.exists()                                # cleaned at open
    assert sorted(store.keys()) == [key_of(i) for i in range(5)]
    for i in range(5):
        assert same_record(store.get(key_of(i)), numbered_record(i)), i
    assert store.get(key_of(5)) is None


def test_writer_killed_at_any_moment_leaves_only_whole_pages(tmp_path):
    lines = run_child_until(tmp_path, hang_at=-1, stop_line=f"DONE {key_of(6)}")
    store = FilePageStore(tmp_path)
    assert not list(tmp_path.glob(".*.tmp"))
    held = store.keys()
    assert {key_of(i) for i in range(7)} <= set(held)      # everything reported done is there
    for key in held:                                        # and every page there is whole
        assert same_record(store.get(key), numbered_record(int(key[4:]))), key
    assert [line[1] for line in lines] == [key_of(i) for i in range(7)]
