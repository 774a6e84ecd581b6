"""Page records: a host copy split into per-page records and joined back byte for byte, through
safetensors bytes, with masks and the boundary compressor state; checked against the pool."""

import pytest
import safetensors.torch
import torch
from mem_pool_testlib import assert_same_copy, fill_random, small_pool

from mem_pool import (boundary_state, join_page_records, record_from_bytes, record_page_size,
                      record_to_bytes, split_host_copy, with_boundary_state)


def through_bytes(records):
    return [record_from_bytes(record_to_bytes(r)) for r in records]


def test_split_join_round_trip_matches_per_page_copies_of_the_pool():
    pool, al = small_pool((0, 4, 0, 4), full_tokens=16 * 16, swa_tokens=16 * 16, page_size=16)
    src = al.alloc_extend([0], [48], [-1], 48)            # 3 pages of 16
    fill_random(pool)
    copy = pool.get_cpu_copy(src, req_pool_idx=1)
    records = through_bytes(split_host_copy(copy, 16))
    assert len(records) == 3
    assert_same_copy(join_page_records(records), copy)
    for page, record in enumerate(records):
        assert record_page_size(record) == 16
        # page i's record holds exactly what the pool gives for page i's locations alone
        alone = pool.get_cpu_copy(src[page * 16:(page + 1) * 16])
        assert_same_copy(join_page_records([with_boundary_state(record, None)]), alone)
        assert record["kv/c4/1/values"].shape[0] == 16 // 4      # one C4 row per 4 tokens
        assert record["kv/swa/0/values"].shape[0] == 16
    # the copy's state is the state after its last token: it rides on the last record only
    assert boundary_state(records[0]) is None and boundary_state(records[1]) is None
    for name, layers in copy.states.items():
        for layer, state in layers.items():
            assert torch.equal(boundary_state(records[2])[name][layer], state)
    # a prefix of the records is the copy of the prefix's locations (no state at its end)
    assert_same_copy(join_page_records(records[:2]), pool.get_cpu_copy(src[:32]))


def test_joined_records_load_into_other_pages_byte_exact():
    pool, al = small_pool((0, 4, 0, 4), full_tokens=16 * 16, swa_tokens=16 * 16, page_size=16)
    src = al.alloc_extend([0], [32], [-1], 32)
    fill_random(pool, seed=3)
    copy = pool.get_cpu_copy(src, req_pool_idx=0)
    joined = join_page_records(through_bytes(split_host_copy(copy, 16)))
    dst = al.alloc(32)
    assert not set(dst.tolist()) & set(src.tolist())
    pool.load_cpu_copy(joined, dst, req_pool_idx=2)
    assert_same_copy(pool.get_cpu_copy(dst, req_pool_idx=2), copy)


def test_pages_without_swa_rows_and_c128_rows():
    pool, al = small_pool((0, 4, 128), full_tokens=8 * 128, swa_tokens=8 * 128, page_size=128,
                          max_num_reqs=2)
    src = al.alloc_extend_swa_tail(3 * 128, 128)          # SWA slots on the last page only
    fill_random(pool, seed=2)
    copy = pool.get_cpu_copy(src)
    records = through_bytes(split_host_copy(copy, 128))
    for page in (0, 1):
        assert not records[page]["kv/swa/mask"].any()
        assert records[page]["kv/swa/0/values"].shape[0] == 0
    assert records[2]["kv/swa/mask"].all()
    assert all(r["kv/c128/2/values"].shape[0] == 1 for r in records)   # 128 / 128
    assert_same_copy(join_page_records(records), copy)


def test_records_are_plain_safetensors():
    pool, al = small_pool((0, 4), full_tokens=8 * 16, swa_tokens=8 * 16, page_size=16)
    src = al.alloc(16)
    fill_random(pool, seed=4)
    record = split_host_copy(pool.get_cpu_copy(src, req_pool_idx=0), 16)[0]
    loaded = safetensors.torch.load(record_to_bytes(record))
    assert set(loaded) == set(record)
    assert any(name.startswith("state/compressor_state/") for name in loaded)
    for name, t in record.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


def test_bad_splits_and_joins_raise():
    pool, al = small_pool((0, 4), full_tokens=8 * 16, swa_tokens=8 * 16, page_size=16)
    src = al.alloc_extend([0], [20], [-1], 20)
    copy = pool.get_cpu_copy(src)
    with pytest.raises(ValueError, match="whole number of pages"):
        split_host_copy(copy, 16)
    records = split_host_copy(pool.get_cpu_copy(src[:16]), 8)
    with pytest.raises(ValueError, match="at least one"):
        join_page_records([])
    fewer = {k: v for k, v in records[1].items() if not k.startswith("kv/c4/")}
    with pytest.raises(ValueError, match="other families"):
        join_page_records([records[0], fewer])
    short = dict(records[1])
    short["kv/swa/0/values"] = short["kv/swa/0/values"][1:]
    with pytest.raises(ValueError, match="rows do not match"):
        join_page_records([records[0], short])
    with pytest.raises(ValueError, match="not a page record entry"):
        join_page_records([{**records[0], "kv/swa/0/other": torch.zeros(1)}])
    # a state table name becomes a path segment of the record's entry names
    with pytest.raises(ValueError, match=r"state table name 'c4/ring' must not contain '/'"):
        with_boundary_state(records[0], {"c4/ring": {0: torch.zeros(2)}})
