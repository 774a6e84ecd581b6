"""Our model over SGLang 0.5.23's own DeepSeekV4TokenToKVPool (`SGLangMonoPool`, a view of its
buffers), against the same model over our pool: a prompt's extend, then decode steps shaped as a
captured step (every token pools, a fixed number of compressed rows, a padded row of request 0
at location 0 and position 0 with length 1, as SGLang pads a graph), batches of 1 and 3 whose
contexts cross C4 and C128 windows and an SWA page (page size 128).

Each side has its own allocator (SGLang's SWATokenToKVPoolAllocator and ReqToTokenPool; ours),
so requests hold other request slots and other locations on each side: the KV rows are compared
per (request, position), read at each side's locations, and the compressor state rows through
each side's addressing (SGLang: a C4 ring per SWA page, a C128 ring per request slot; ours: a
ring per request slot). SGLang's C4 rings start as `torch.empty`; here every row but its empty
sentinel starts as NaN, so a row read before its request wrote it would show in the logits.
Also: SGLang's indexer keys in its preshuffled 16 x 16 tiles (the model reads and writes them in
that order), the decode plans on attention_plan's Triton kernel (interpreted), the window stores
translating through SGLang's mapping themselves, and each pool the view refuses, by name."""

import dataclasses

import pytest
import torch

from sglang_host import install_cpu_context, make_pool, use_stubs

use_stubs()
pytest.importorskip("sglang.srt.mem_cache.deepseek_v4_memory_pool",
                    reason="SGLang is not installed (see README)")

from dsv4.plugins.sglang_mono_pool import SGLangMonoPool, mono_pool_problem  # noqa: E402
from sglang_mono_sides import (MAX_CTX, PAGE, TORCH, assert_same_kv, our_side,  # noqa: E402
                               rows_by_position, run, sglang_side)
from plan_backend import plans_on_triton  # noqa: E402
from tiny_model import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model():
    install_cpu_context()
    return tiny_model(MAX_CTX, seed=5)


@pytest.mark.parametrize("prompt_lens, steps", [
    ([125], 6),               # C4 windows, the C128 window closing at 127, SWA page 1 -> 2
    ([120, 250, 61], 9),      # and position 255 (C128, a page edge) and a short prompt
], ids=["batch1", "batch3"])
def test_the_model_over_sglangs_pool_writes_and_computes_what_it_does_over_ours(
        model, prompt_lens, steps):
    ours, theirs = our_side(model, len(prompt_lens)), sglang_side(model, len(prompt_lens))
    want = run(model, ours, prompt_lens, steps, TORCH)
    got = run(model, theirs, prompt_lens, steps, TORCH)
    assert ours.slots != theirs.slots
    for w, g in zip(want, got):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
        assert not g.isnan().any()
    assert_same_kv(model, ours, theirs)


def test_sglangs_preshuffled_indexer_keys_are_read_and_written_in_their_tiles(model,
                                                                              monkeypatch):
    """SGLang preshuffling its indexer payload (its ROCm default with aiter, stood in for by
    `_indexer_preshuffled`): the view serves key tile 16, and the model over it gives the logits
    it gives over our row-major pool, its indexer keys the same once un-tiled (and not where a
    row-major reader would look: the tiles are really there)."""
    from dsv4.plugins import sglang_mono_pool

    monkeypatch.setattr(sglang_mono_pool, "_indexer_preshuffled", lambda: True)
    ours, theirs = our_side(model, 1), sglang_side(model, 1)
    assert (ours.pool.indexer_key_tile, theirs.pool.indexer_key_tile) == (0, 16)
    want = run(model, ours, [125], 6, TORCH)
    got = run(model, theirs, [125], 6, TORCH)
    for w, g in zip(want, got):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    assert_same_kv(model, ours, theirs)
    layer = model.config.compress_ratios.index(4)
    row_major = rows_by_position(theirs, layer, 4, key_tile=0)
    untiled = rows_by_position(theirs, layer, 4)
    keys = [k for k in untiled if k[1] == "indexer"]
    assert keys and any(not torch.equal(untiled[k][0], row_major[k][0]) for k in keys)


def test_a_decode_planned_by_the_triton_kernel_addresses_sglangs_rings(model, monkeypatch):
    """The decode steps' plans on attention_plan's Triton kernel (interpreted on a CPU; every
    other op and the extend's plan on torch): the same logits and bytes as over our pool."""
    pytest.importorskip("triton")
    ours, theirs = our_side(model, 1), sglang_side(model, 1)
    want = run(model, ours, [125], 4, TORCH)
    ran = plans_on_triton(monkeypatch)
    got = run(model, theirs, [125], 4, TORCH)
    assert ran == {"triton", "torch"}
    for w, g in zip(want, got):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    assert_same_kv(model, ours, theirs)


def test_the_stores_may_translate_through_sglangs_mapping(model):
    """fused_swa_translate: each window store maps out_cache_loc through the pool's registered
    mapping itself (SGLang's allocator's)."""
    fused = dataclasses.replace(TORCH, fused_swa_translate=True)
    ours, theirs = our_side(model, 1), sglang_side(model, 1)
    want, got = run(model, ours, [125], 3, fused), run(model, theirs, [125], 3, fused)
    for w, g in zip(want, got):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    assert_same_kv(model, ours, theirs)


def _set(path, value):
    def change(pool):
        *owner, name = path.split(".")
        target = pool
        for part in owner:
            target = target[int(part)] if part.isdigit() else getattr(target, part)
        setattr(target, name, value)
    return change


def _states(layer, **values):
    def change(pool):
        for name, value in values.items():
            setattr(pool.get_attention_compress_states(layer), name, value)
    return change


def _kv_pool_class(name):
    def change(pool):
        pool.kv_pools[4] = type(name, (), {})()
    return change


def _layout(ratio_value):
    def change(pool):
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
        pool.compressed_kv_layout = lambda ratio: KVLayout.V41 if ratio == ratio_value else \
            KVLayout.V4
    return change


@pytest.mark.parametrize("change, named", [
    (_set("index_pools.4.use_fp4_indexer", True), "FP4 keys"),
    (_set("request_window", object()), "request window"),
    (_set("uniform_fp8", True), "uniform FP8"),
    (_set("_unified_kv", True), "unified KV layout"),
    (_set("swa_kv_pool.page_size", 64), "physical SWA page size 64"),
    (_set("swa_req_ring_size", 256), "per-request ring"),
    (_set("_stage_start", 1), "pipeline stage"),
    (_kv_pool_class("HiSparseC4DevicePool"), "HiSparseC4DevicePool"),
    (_layout(128), "C128 KV layout is 'v41'"),
    (_states(2, online=True, ring_size=1), "online compression"),
    (_states(1, ring_size=16), "ring of 16"),
    (_states(1, request_scoped=True), "request-scoped"),
], ids=["fp4_indexer", "request_window", "uniform_fp8", "unified_kv", "physical_swa_page",
        "swa_ring", "pp_stage", "hisparse", "c128_layout", "online_c128", "c4_ring",
        "c4_scope"])
def test_a_pool_the_view_cannot_serve_is_refused_by_name(model, change, named):
    ratios = tuple(model.config.compress_ratios[:model.config.n_layers])
    pool = make_pool(swa_pages=2, page_size=PAGE, layers=ratios)
    assert mono_pool_problem(pool, ratios) is None
    change(pool)
    with pytest.raises(ValueError, match=f"pool: .*{named}"):
        SGLangMonoPool(pool, ratios)


def test_other_refusals_are_named(model, monkeypatch):
    from dsv4.plugins import sglang_mono_pool

    ratios = tuple(model.config.compress_ratios[:model.config.n_layers])
    pool = make_pool(swa_pages=2, page_size=PAGE, layers=ratios)
    with pytest.raises(ValueError, match="compression_ratios"):
        SGLangMonoPool(pool, (0, 4, 4, 4))
    monkeypatch.setattr(sglang_mono_pool, "_indexer_preshuffled", lambda: True)
    small = make_pool(swa_pages=2, page_size=32, layers=(0, 4))   # indexer pages of 8 rows
    with pytest.raises(ValueError, match="16 x 16 tiles but its page holds 8 rows"):
        SGLangMonoPool(small, (0, 4))
    monkeypatch.undo()
    pool.swa_page_size = pool.swa_kv_pool.page_size = PAGE // 2
    with pytest.raises(ValueError, match=f"SWA page size {PAGE // 2} differs from its page size"):
        SGLangMonoPool(pool, ratios)
