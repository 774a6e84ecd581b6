"""The engine's KV slots (dsv4.kv_slots.KVSlots) on a small CPU pool: what each operation takes
and gives back, counted from the page and window arithmetic; a retracted request's KV comes
back byte for byte in other pages and another slot; bad input raises naming the argument, with
nothing taken. The engine's end-to-end use is in test_runtime_engine.py and
test_runtime_swa_release_and_retraction.py."""

import pytest
import torch
from mem_pool_testlib import assert_same_copy, fill_random

from dsv4.kv_slots import KVSlots, pool_sizes
from dsv4.request import Request
from mem_pool import KVCacheSpec
from mem_pool.kv_cache_spec import footprint

P, W, MAX_LEN = 16, 32, 128             # page, window (two pages), a request's longest
SPEC = KVCacheSpec((0, 4, 0, 4), window_size=W)


def make_slots(pages=8, swa_pages=None, max_requests=2) -> KVSlots:
    return KVSlots(SPEC, pages * P, (pages if swa_pages is None else swa_pages) * P, P,
                   max_requests, MAX_LEN, "cpu")


def held(slots):
    """(full tokens, SWA tokens, request slots) free now."""
    a = slots.allocator
    return a.full_available_size(), a.swa_available_size(), slots.req_to_token_pool.available()


def requests(*lens):
    return [Request(i, [2] * n, 4) for i, n in enumerate(lens)]


def test_take_gives_pages_from_a_page_boundary_a_slot_and_its_table_row():
    slots = make_slots()
    reqs = requests(20, 5)
    locs = slots.take(reqs, [20, 5])
    assert locs.tolist() == reqs[0].locs + reqs[1].locs
    assert [len(r.locs) for r in reqs] == [20, 5] and all(r.locs[0] % P == 0 for r in reqs)
    assert sorted(r.slot for r in reqs) == [1, 2] and all(r.swa_freed_to == 0 for r in reqs)
    for r in reqs:
        assert slots.req_to_token_pool.req_to_token[r.slot, :len(r.locs)].tolist() == r.locs
    assert held(slots) == (5 * P, 5 * P, 0)          # 2 + 1 pages on each side, both slots
    assert slots.free_pages() == 5 and slots.pages(20) == 2 and slots.capacity_pages() == 8
    assert slots.tokens_in_use() == (3 * P, 3 * P)


@pytest.mark.parametrize("short", ["pages", "slots"])
def test_take_returns_none_with_nothing_taken_when_pages_or_slots_are_short(short):
    slots = make_slots(pages=2, max_requests=1 if short == "slots" else 2)
    reqs = requests(3 * P, 1) if short == "pages" else requests(1, 1)
    before = held(slots)
    assert slots.take(reqs, [len(r.prompt) for r in reqs]) is None
    assert held(slots) == before and all(r.slot is None and r.locs == [] for r in reqs)


def test_extend_continues_each_requests_last_page_then_takes_new_ones():
    """A prompt's next chunk: 20 positions, then 5 more (page 2 goes on), then 13 (fills page 2
    and takes page 3); the table row and locs follow, seq_len is the engine's to set."""
    slots = make_slots()
    reqs = requests(38, 5)
    slots.take(reqs, [20, 5])
    locs = slots.extend(reqs, [5, 12])
    assert locs.tolist() == reqs[0].locs[20:] + reqs[1].locs[5:]
    assert reqs[0].locs[20:] == list(range(reqs[0].locs[19] + 1, reqs[0].locs[19] + 6))
    slots.extend(reqs[:1], [13])
    for r in reqs:
        assert slots.req_to_token_pool.req_to_token[r.slot, :len(r.locs)].tolist() == r.locs
    assert [len(r.locs) for r in reqs] == [38, 17] and [r.seq_len for r in reqs] == [0, 0]
    assert held(slots)[:2] == (3 * P, 3 * P)      # 3 + 2 pages held of 8
    assert len({loc // P for loc in reqs[0].locs}) == 3


def test_extend_refuses_a_request_without_a_slot_or_past_its_context_with_nothing_taken():
    slots = make_slots()
    reqs = requests(4, 4)
    slots.take(reqs[:1], [4])
    before = held(slots)
    with pytest.raises(ValueError, match=r"reqs\[1\] \(request 1\) holds no request slot"):
        slots.extend(reqs, [1, 1])
    with pytest.raises(ValueError, match=r"tokens\[0\]=125 after the 4 positions"):
        slots.extend(reqs[:1], [MAX_LEN - 3])
    with pytest.raises(ValueError, match=r"tokens\[0\] must be an int >= 1"):
        slots.extend(reqs[:1], [0])
    assert held(slots) == before and len(reqs[0].locs) == 4


def test_grow_writes_the_next_position_and_counts_it():
    slots = make_slots()
    reqs = requests(P, 3)
    slots.take(reqs, [P, 3])
    for r in reqs:
        r.seq_len = len(r.locs)
    locs = slots.grow(reqs)
    assert [r.seq_len for r in reqs] == [P + 1, 4]
    assert locs == [reqs[0].locs[-1], reqs[1].locs[-1]]
    assert reqs[0].locs[-1] % P == 0                 # position 16 opens a new page
    assert reqs[1].locs[-1] == reqs[1].locs[-2] + 1  # position 3 continues its page
    slots.write_grown(torch.tensor([r.slot for r in reqs]),
                      torch.tensor([r.seq_len - 1 for r in reqs]), torch.tensor(locs), P)
    table = slots.req_to_token_pool.req_to_token
    assert [int(table[r.slot, r.seq_len - 1]) for r in reqs] == locs


def test_write_grown_names_a_position_past_the_table():
    slots = make_slots()
    with pytest.raises(ValueError, match="positions up to"):
        slots.write_grown(torch.tensor([1]), torch.tensor([MAX_LEN]), torch.tensor([P]), MAX_LEN)


def test_grow_returns_none_with_nothing_taken_when_the_pool_is_short():
    slots = make_slots(pages=1)
    [req] = requests(P)
    slots.take([req], [P])
    req.seq_len = P
    before, locs = held(slots), list(req.locs)
    assert slots.grow([req]) is None
    assert held(slots) == before and req.locs == locs and req.seq_len == P


def test_release_out_of_window_frees_only_the_whole_pages_before_the_window_once():
    slots = make_slots()
    [req] = requests(70)
    slots.take([req], [70])
    swa_free = slots.allocator.swa_available_size()
    slots.release_out_of_window(req, 70)             # (70 - 32) // 16 = 2 pages left the window
    assert req.swa_freed_to == 2 * P
    assert slots.allocator.swa_available_size() == swa_free + 2 * P
    assert slots.allocator.full_available_size() == 3 * P      # full pages stay
    slots.release_out_of_window(req, 70)             # nothing new left the window
    slots.release_out_of_window(req, 40)             # fewer positions: nothing to undo
    assert slots.allocator.swa_available_size() == swa_free + 2 * P and req.swa_freed_to == 2 * P


def test_release_gives_back_pages_and_slot():
    slots = make_slots()
    [req] = requests(70)
    slots.take([req], [70])
    slots.release_out_of_window(req, 70)
    slots.release(req)
    assert held(slots) == (8 * P, 8 * P, 2) and req.slot is None and req.locs == []


def test_a_retracted_request_comes_back_byte_for_byte_in_other_pages_and_slot():
    """Retraction's path: host copy, release, take (another slot: the first is still held by a
    request taken in between), free the SWA pages before the window, load the copy."""
    slots = make_slots(pages=12, max_requests=3)
    [req, other] = requests(75, 20)
    slots.take([req], [75])
    slots.release_out_of_window(req, 75)
    fill_random(slots.pool, seed=7)
    copy = slots.host_copy(req)
    assert copy.num_tokens == 75 and copy.families["swa"].mask.sum() == 75 - 2 * P
    rows = slots.host_rows(req, P, 3 * P)
    old_slot, old_locs = req.slot, list(req.locs)
    slots.release(req)
    slots.take([other], [20])
    assert slots.take([req], [75]) is not None
    assert req.slot != old_slot and req.locs != old_locs
    slots.release_out_of_window(req, 75)
    slots.load_host_copy(req, copy)
    assert_same_copy(slots.host_copy(req), copy)
    assert_same_copy(slots.host_rows(req, P, 3 * P), rows)


def test_host_rows_are_the_rows_of_those_positions_without_state():
    slots = make_slots()
    [req] = requests(40)
    slots.take([req], [40])
    fill_random(slots.pool, seed=8)
    whole, part = slots.host_copy(req), slots.host_rows(req, P, 2 * P)
    assert part.states is None and part.num_tokens == P
    assert_same_copy(part, slots.pool.get_cpu_copy(torch.tensor(req.locs[P:2 * P])))
    assert torch.equal(part.families["swa"].mask, whole.families["swa"].mask[P:2 * P])


def test_clear_state_resets_the_slots_rings():
    slots = make_slots()
    [req] = requests(8)
    slots.take([req], [8])
    fill_random(slots.pool, seed=9)
    slots.clear_state([req])
    for table in (slots.pool.compressor_states, slots.pool.indexer_compressor_states):
        for state in table.values():
            kv, score = state[req.slot].chunk(2, dim=-1)
            assert (kv == 0).all() and (score == float("-inf")).all()


def test_pool_sizes_from_tokens_bytes_or_the_default():
    assert pool_sizes(SPEC, P, 2, 40) == (2 * 3 * P, 2 * 3 * P)     # 40 tokens: 3 pages each
    assert pool_sizes(SPEC, P, 2, 40, max_total_tokens=4 * P, swa_tokens=2 * P) == (4 * P, 2 * P)
    full, swa = pool_sizes(SPEC, P, 2, 40, kv_bytes=2**20)
    assert full % P == swa % P == 0 and min(full, swa) >= P
    assert KVSlots(SPEC, full, swa, P, 2, 40, "cpu").pool.nbytes <= 2**20
    more = pool_sizes(SPEC, P, 2, 40, kv_bytes=2**21)
    assert more[0] > full and more[1] > swa


def test_bad_input_raises_naming_the_argument_with_nothing_taken():
    for name in ("page_size", "max_requests", "max_context_len"):
        kw = dict(page_size=P, max_requests=2, max_context_len=MAX_LEN) | {name: 0}
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got 0"):
            KVSlots(SPEC, 4 * P, 4 * P, kw["page_size"], kw["max_requests"],
                    kw["max_context_len"], "cpu")
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got 0"):
            KVSlots.sized(SPEC, kw["page_size"], kw["max_requests"], kw["max_context_len"],
                          "cpu")
    with pytest.raises(ValueError, match="not both"):
        pool_sizes(SPEC, P, 2, 40, max_total_tokens=4 * P, kv_bytes=2**20)
    fp = footprint(SPEC, P)
    one_full_page = fp.total_bytes(0, 0, 3) + fp.full_page_bytes    # no room for an SWA page
    with pytest.raises(ValueError, match=f"kv_bytes={one_full_page} holds less than one page"):
        pool_sizes(SPEC, P, 2, 40, kv_bytes=one_full_page)

    slots = make_slots()
    [req, free] = requests(20, 5)
    slots.take([req], [20])
    before = held(slots)
    for reqs, tokens, match in (([free], [5, 1], r"tokens must hold one count per request"),
                                ([], [], r"tokens must hold one count per request"),
                                ([free], [0], r"tokens\[0\] must be an int >= 1, got 0"),
                                ([free], [2.0], r"tokens\[0\] must be an int >= 1, got 2.0"),
                                ([free], [MAX_LEN + 1], r"tokens\[0\]=129 exceeds max_context_len"),
                                ([free, req], [5, 20], r"reqs\[1\] \(request 0\) already holds")):
        with pytest.raises(ValueError, match=match):
            slots.take(reqs, tokens)
    with pytest.raises(ValueError, match="running must hold at least one request"):
        slots.grow([])
    with pytest.raises(ValueError, match=r"running\[1\] \(request 1\) holds no request slot"):
        slots.grow([req, free])
    for tokens in (-1, 21, True):
        with pytest.raises(ValueError, match=r"tokens must be an int in 0\.\.20"):
            slots.release_out_of_window(req, tokens)
    for call in (slots.release, slots.host_copy):
        with pytest.raises(ValueError, match=r"req \(request 1\) holds no request slot"):
            call(free)
    with pytest.raises(ValueError, match=r"reqs\[0\] \(request 1\) holds no request slot"):
        slots.clear_state([free])
    for start, end in ((5, 5), (-1, 4), (0, 21)):
        with pytest.raises(ValueError, match=f"start={start}, end={end}: expected"):
            slots.host_rows(req, start, end)
    long_copy = slots.host_copy(req)
    short = Request(2, [2] * 5, 4)
    slots.take([short], [5])
    with pytest.raises(ValueError, match="copy holds 20 positions; request 2 holds 5"):
        slots.load_host_copy(short, long_copy)
    slots.release(short)
    assert held(slots) == before and free.slot is None
