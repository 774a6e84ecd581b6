"""The identity-keyed SWA location cache: the upstream refactor's properties, the failure modes
of earlier designs, its switches (read once, at construction), graph capture, and the
translation count per decode step."""

import gc
import weakref

import pytest
import torch
from mem_pool_testlib import FLASH_RATIOS, PRO_RATIOS, expected_swa, small_pool

from hip_kernels.capture import set_emulated_capture
from mem_pool import (KVCacheSpec, StaleSwaLocError, SwaLocCache, SwaLocStats,
                      create_dsv4_kv_cache)

P = 4
LAYERS = 6


def layered_pool(**switches):
    return small_pool(ratios=(0,) * LAYERS, full_tokens=32 * P, swa_tokens=32 * P, page_size=P,
                      **switches)


@pytest.fixture(params=["verify", "fast path"])
def pa(request):
    """The cache on, either with every hit re-checked (swa_cache_verify=True: a stale hit
    raises) or as deployed (hits of the last tensor take the fast path)."""
    return layered_pool(cache_swa_translation=True,
                        swa_cache_verify=request.param == "verify")


def forward(pool, loc, layers=range(LAYERS)):
    return [pool.get_cached_swa_loc(loc, layer_id) for layer_id in layers]


def check(pool, al, loc):
    got = pool.get_cached_swa_loc(loc)
    assert got.dtype == torch.int32
    assert torch.equal(got, expected_swa(al, loc))


# ---- the upstream refactor's properties ---------------------------------------------------


def test_two_view_objects_of_the_same_memory_hit(pa):
    pool, al = pa
    loc = al.alloc(2 * P)
    pool.get_cached_swa_loc(loc[:])
    before = pool.swa_loc_stats.translations
    assert torch.equal(pool.get_cached_swa_loc(loc.view(-1)), expected_swa(al, loc))
    assert pool.swa_loc_stats.translations == before
    assert pool.swa_loc_stats.hits == 1


def test_views_at_different_offsets_translate_apart(pa):
    pool, al = pa
    base = al.alloc(4 * P)
    first, second = base[:2 * P], base[2 * P:]
    # The earlier key (storage pointer, numel) is the same for both views ...
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert first.numel() == second.numel()
    # ... ours is not.
    assert first.data_ptr() != second.data_ptr()
    check(pool, al, first)
    check(pool, al, second)
    assert pool.swa_loc_stats.misses == 2


def test_same_address_and_numel_with_other_strides_translate_apart(pa):
    pool, al = pa
    base = al.alloc(4 * P)
    dense, strided = base[:2 * P], base[::2]
    assert dense.data_ptr() == strided.data_ptr() and dense.numel() == strided.numel()
    check(pool, al, dense)
    check(pool, al, strided)


def _mutators(pool, al, loc):
    """Each mutation of the mapping, applied to a pool whose loc is cached."""
    page = al.full_attn_allocator.page_locations(loc[:1] // P)
    return {
        "alloc": lambda: al.alloc(P),
        "alloc_extend": lambda: al.alloc_extend([0], [3], [-1], 3),
        "alloc_decode": lambda: al.alloc_decode([2 * P + 1], [int(loc[-1])]),
        "alloc_extend_swa_tail": lambda: al.alloc_extend_swa_tail(6, 2),
        "free": lambda: al.free(loc),
        "free_swa": lambda: al.free_swa(page),
        "free_swa_out_of_window": lambda: al.free_swa_out_of_window(loc, 2 * P, 1),
        "set_full_to_swa_mapping": lambda: (al.free_swa(page), al.set_full_to_swa_mapping(
            page, al.swa_attn_allocator.alloc(P))),
        "clear": lambda: al.clear(),
        "restore_state": lambda: al.restore_state(al.backup_state()),
        "register_mapping": lambda: pool.register_mapping(al.full_to_swa_index_mapping),
    }


MUTATORS = ["alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail", "free", "free_swa",
            "free_swa_out_of_window", "set_full_to_swa_mapping", "clear", "restore_state",
            "register_mapping"]


@pytest.mark.parametrize("mutator", MUTATORS)
def test_every_mutator_invalidates(pa, mutator):
    pool, al = pa
    loc = al.alloc(2 * P)
    pool.get_cached_swa_loc(loc)
    gen = pool.mapping_generation
    _mutators(pool, al, loc)[mutator]()
    assert pool.mapping_generation > gen
    misses = pool.swa_loc_stats.misses
    check(pool, al, loc)
    assert pool.swa_loc_stats.misses == misses + 1


def test_invalidation_is_idempotent_and_the_fresh_pool_no_op_does_not_raise(pa):
    pool, al = pa
    fresh = small_pool()[0]
    fresh.invalidate_loc_cache()
    SwaLocCache(SwaLocStats()).invalidate()
    loc = al.alloc(P)
    pool.get_cached_swa_loc(loc)
    pool.invalidate_loc_cache()
    pool.invalidate_loc_cache()
    check(pool, al, loc)
    assert pool.swa_loc_stats.misses == 2


# ---- the failure modes of earlier designs ---------------------------------------------------


def test_static_buffer_refilled_in_place(pa):
    pool, al = pa
    a, b = al.alloc(P), al.alloc(P)
    static = torch.zeros(P, dtype=torch.int64)
    static.copy_(a)
    check(pool, al, static)
    static.copy_(b)                       # same address, same numel, new contents
    check(pool, al, static)


def test_freed_loc_tensor_cannot_be_recycled_while_cached_and_a_reused_address_misses(pa):
    pool, al = pa
    loc = al.alloc(P)
    storage = loc.untyped_storage()
    pool.get_cached_swa_loc(loc)
    alive = weakref.ref(loc)
    del loc
    gc.collect()
    assert alive() is not None            # the cache holds it: its memory is not reused
    al.free(alive())
    nxt = al.alloc(2 * P)                 # the next batch ...
    reused = torch.empty(0, dtype=torch.int64).set_(storage, 0, (P,))
    reused.copy_(nxt[P:])                 # ... written at the very same address
    check(pool, al, reused)
    pool.invalidate_loc_cache()
    gc.collect()
    del reused, storage
    gc.collect()
    assert alive() is None                # dropped entries release the tensor


def test_mapping_rebuilt_by_set_full_to_swa_mapping(pa):
    pool, al = pa
    loc = al.alloc(2 * P)
    first = pool.get_cached_swa_loc(loc).clone()
    al.free_swa(loc)
    al.swa_attn_allocator.alloc(2 * P)    # occupy the old slots
    al.set_full_to_swa_mapping(loc, al.swa_attn_allocator.alloc(2 * P))
    check(pool, al, loc)
    assert not torch.equal(pool.get_cached_swa_loc(loc), first)


def test_forward_that_starts_at_another_layer(flag_env):
    flag_env()
    spec_kw = dict(start_layer=10, end_layer=16)
    pool, al = small_pool(ratios=(0,) * 20, full_tokens=16 * P, swa_tokens=16 * P, page_size=P,
                          **spec_kw)
    step1 = al.alloc(P)
    forward(pool, step1, range(10, 16))
    step2 = al.alloc_decode([P + 1], [int(step1[-1])])
    # a draft / later pipeline stage forward begins at layer 13, never at start_layer
    for got in forward(pool, step2, [13, 14, 15, 10, 11, 12]):
        assert torch.equal(got, expected_swa(al, step2))
    assert pool.swa_loc_stats.translations == 2


def test_two_micro_batches_interleaving_layers(pa):
    pool, al = pa
    a, b = al.alloc(P), al.alloc(2 * P)
    for layer in range(LAYERS):
        assert torch.equal(pool.get_cached_swa_loc(a, layer), expected_swa(al, a))
        assert torch.equal(pool.get_cached_swa_loc(b, layer), expected_swa(al, b))
    assert pool.swa_loc_stats.translations == 2


# ---- what else could change the answer without changing the key -----------------------------


def test_a_returned_tensor_modified_by_the_caller_is_not_served_again(pa):
    pool, al = pa
    loc = al.alloc(P)
    pool.get_cached_swa_loc(loc).fill_(7)
    check(pool, al, loc)


def test_a_second_pool_sharing_the_mapping_never_goes_stale(pa):
    pool, al = pa
    draft = small_pool(ratios=(0,), full_tokens=32 * P, swa_tokens=32 * P, page_size=P)[0]
    draft.register_mapping(al.full_to_swa_index_mapping)   # only the mapping is shared
    loc = al.alloc(P)
    check(draft, al, loc)
    al.free_swa(loc)                                        # bumps `pool`, not `draft`
    check(draft, al, loc)


def test_inference_mode_location_tensors_are_translated_every_call(pa, caplog):
    pool, al = pa
    loc = al.alloc(P)
    with torch.inference_mode():
        frozen = loc.clone()
        forward(pool, frozen)
    assert pool.swa_loc_stats.translations == LAYERS and pool.swa_loc_stats.hits == 0
    assert "inference_mode" in caplog.text
    with torch.inference_mode():
        forward(pool, loc)                                  # allocator output: cached
    assert pool.swa_loc_stats.translations == LAYERS + 1


def test_the_inference_mode_warning_is_logged_once_per_cache(pa, caplog):
    """Every layer of every step translates an unversioned tensor: the log says so once."""
    pool, al = pa
    with torch.inference_mode():
        frozen = al.alloc(P).clone()
        forward(pool, frozen)
        forward(pool, frozen.clone())
    warnings = [r for r in caplog.records if "inference_mode" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"


def test_graph_capture_never_reuses_a_warm_up_entry_and_never_syncs(pa, monkeypatch):
    pool, al = pa
    loc = al.alloc(P)
    forward(pool, loc)                                      # warm-up run
    assert pool.swa_loc_stats.translations == 1

    def no_sync(*args, **kwargs):
        raise AssertionError("host synchronization during capture")

    set_emulated_capture(True)
    try:
        for name in ("item", "tolist", "__int__", "__bool__", "cpu"):
            monkeypatch.setattr(torch.Tensor, name, no_sync)
        forward(pool, loc)                                  # the capture records the gather
        monkeypatch.undo()
    finally:
        set_emulated_capture(False)
    assert pool.swa_loc_stats.translations == 2
    forward(pool, loc)                                      # not the captured tensor
    assert pool.swa_loc_stats.translations == 3


def test_cache_off_translates_every_call():
    pool, al = layered_pool(cache_swa_translation=False)
    loc = al.alloc(P)
    for got in forward(pool, loc):
        assert torch.equal(got, expected_swa(al, loc))
    assert pool.swa_loc_stats.translations == LAYERS and pool.swa_loc_stats.hits == 0


@pytest.mark.parametrize("at_construction, later", [("0", "1"), ("1", "0")])
def test_the_flags_are_read_once_when_the_pool_is_made(flag_env, at_construction, later):
    """None follows DSV4_CACHE_SWA_TRANSLATION as it is when the pool is made; a flag changed
    afterwards changes nothing in that pool."""
    flag_env(DSV4_CACHE_SWA_TRANSLATION=at_construction, DSV4_SWA_CACHE_VERIFY="1")
    pool, al = layered_pool()
    flag_env(DSV4_CACHE_SWA_TRANSLATION=later, DSV4_SWA_CACHE_VERIFY="0")
    loc = al.alloc(P)
    forward(pool, loc)
    assert pool.swa_loc_stats.translations == (1 if at_construction == "1" else LAYERS)
    if at_construction == "1":                         # verify stayed on: no fast path
        loc.data.copy_(loc.data.flip(0))
        with pytest.raises(StaleSwaLocError):
            pool.get_cached_swa_loc(loc)


@pytest.mark.parametrize("name, value", [("cache_swa_translation", 1),
                                         ("swa_cache_verify", "0")])
def test_switches_must_be_bools(name, value):
    with pytest.raises(TypeError, match=f"{name} must be a bool, or None to read DSV4_"):
        layered_pool(**{name: value})


def test_cache_keeps_at_least_two_entries():
    with pytest.raises(ValueError, match="capacity must be >= 2"):
        SwaLocCache(SwaLocStats(), capacity=1)


# ---- bad input ------------------------------------------------------------------------------


def test_bad_locations_raise_naming_loc(pa):
    pool, al = pa
    al.alloc(P)
    with pytest.raises(TypeError, match="loc must have dtype"):
        pool.get_cached_swa_loc(torch.tensor([1.0]))
    with pytest.raises(IndexError, match=r"loc holds 132; valid full-pool locations are 0..131"):
        pool.get_cached_swa_loc(torch.tensor([4, 132]))
    with pytest.raises(IndexError, match="loc holds -2"):
        pool.translate_loc_from_full_to_swa(torch.tensor([-2]))
    with pytest.raises(ValueError, match="loc must be on cpu"):
        pool.get_cached_swa_loc(torch.zeros(2, dtype=torch.int64, device="meta"))
    assert pool.translate_loc_from_full_to_swa(torch.tensor([-1, 0])).tolist() == [-1, 0]
    with pytest.raises(RuntimeError, match="no full->SWA mapping registered"):
        small_pool()[0].__class__(KVCacheSpec((0,)), 16, 16, 4).get_cached_swa_loc(
            torch.tensor([0]))


# ---- translations per decode step (the number the issue asks for) ----------------------------


@pytest.mark.parametrize("ratios, layers", [(FLASH_RATIOS, 43), (PRO_RATIOS, 61)])
@pytest.mark.parametrize("cache", [True, False])
def test_translations_per_decode_step(ratios, layers, cache):
    spec = KVCacheSpec(ratios, end_layer=layers)
    page = 128
    pool, al = create_dsv4_kv_cache(spec, 2 * page, 2 * page, page, "cpu", max_num_reqs=1,
                                    cache_swa_translation=cache)
    prompt = al.alloc_extend([0, 0], [5, 9], [-1, -1], 14)
    seq_lens, last = torch.tensor([5, 9]), prompt[[4, 13]]
    per_step = []
    for _ in range(3):
        seq_lens = seq_lens + 1
        out_cache_loc = al.alloc_decode(seq_lens, last)
        pool.swa_loc_stats.reset()
        for layer_id in spec.layer_ids:                     # as every decoder layer does
            swa_loc = pool.get_cached_swa_loc(out_cache_loc, layer_id)
            assert torch.equal(swa_loc, expected_swa(al, out_cache_loc))
        per_step.append(pool.swa_loc_stats.translations)
        last = out_cache_loc
    assert per_step == [1 if cache else layers] * 3



def _graph_api(kind):
    """(graph object, capture context, device): a CUDA graph, or the CPU emulation of one."""
    if kind == "cuda":
        return torch.cuda.CUDAGraph(), torch.cuda.graph, "cuda"
    from dsv4.graphs.emulation import EmulatedGraph, graph
    return EmulatedGraph(), graph, "cpu"


@pytest.mark.parametrize("kind", ["emulate", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_captured_graph_records_the_gather_even_after_a_warm_up(flag_env, kind):
    flag_env()
    graph, capture, device = _graph_api(kind)
    pool, al = create_dsv4_kv_cache(KVCacheSpec((0,) * 4), 16 * 16, 16 * 16, 16, device,
                                    max_num_reqs=2)
    static_loc = torch.zeros(8, dtype=torch.int64, device=device)
    out = torch.zeros(4, 8, dtype=torch.int32, device=device)

    def step():
        for layer_id in range(4):
            out[layer_id].copy_(pool.get_cached_swa_loc(static_loc, layer_id))

    static_loc.copy_(al.alloc(16)[:8])
    with torch.no_grad():
        step()                                              # warm-up caches the translation
        with capture(graph):                                # must not sync, must gather
            step()
    nxt = al.alloc(16)[8:]
    static_loc.copy_(nxt)
    graph.replay()
    if kind == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, expected_swa(al, nxt).expand(4, 8))


WRITES_PAST_THE_VERSION_COUNTER = [
    lambda t: t.data.copy_(t.data.flip(0)),
    lambda t: t.numpy().__setitem__(slice(None), t.numpy()[::-1].copy())]


@pytest.mark.parametrize("write", WRITES_PAST_THE_VERSION_COUNTER, ids=["data", "numpy"])
def test_writes_that_bypass_the_version_counter_are_caught_by_verify(write):
    """Writes through .data or a numpy view leave the version counter alone: with
    swa_cache_verify the hit raises; without it the cache serves the old translation until
    invalidate_loc_cache()."""
    for verify in (True, False):
        pool, al = layered_pool(cache_swa_translation=True, swa_cache_verify=verify)
        loc = al.alloc(8)
        before = pool.get_cached_swa_loc(loc, 0).clone()
        write(loc)
        assert not torch.equal(pool.translate_loc_from_full_to_swa(loc), before)
        if verify:
            with pytest.raises(StaleSwaLocError, match="stale at positions"):
                pool.get_cached_swa_loc(loc, 1)
            continue
        assert torch.equal(pool.get_cached_swa_loc(loc, 2), before)   # served stale
        pool.invalidate_loc_cache()
        assert torch.equal(pool.get_cached_swa_loc(loc, 3),
                           pool.translate_loc_from_full_to_swa(loc))


def test_the_fast_path_serves_the_last_tensor_and_misses_on_any_change(pa):
    pool, al = pa
    loc, other = al.alloc(2 * P), al.alloc(2 * P)
    fresh = expected_swa(al, loc)
    first = pool.get_cached_swa_loc(loc)
    hits = pool.swa_loc_stats.hits
    assert pool.get_cached_swa_loc(loc) is first and pool.swa_loc_stats.hits == hits + 1
    loc.data = other                                   # .data assignment: a new address
    assert torch.equal(pool.get_cached_swa_loc(loc), expected_swa(al, loc))
    assert not torch.equal(expected_swa(al, loc), fresh)
