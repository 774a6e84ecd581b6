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
Also: the decode plans on attention_plan's Triton kernel (interpreted), the window stores
translating through SGLang's mapping themselves, and each pool the view refuses, by name."""

import dataclasses
import importlib

import pytest
import torch

from sglang_host import install_cpu_context, make_pool, use_stubs

use_stubs()
pytest.importorskip("sglang.srt.mem_cache.deepseek_v4_memory_pool",
                    reason="SGLang is not installed (see README)")

from dsv4.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from dsv4.options import Options  # noqa: E402
from dsv4.plugins.sglang_mono_pool import SGLangMonoPool, mono_pool_problem  # noqa: E402
from hip_kernels import KernelOptions  # noqa: E402
from hip_kernels.kv_layout import INDEX_DIM, read_kv_bytes  # noqa: E402
from mem_pool.dsv4_pool import create_dsv4_kv_cache  # noqa: E402
from mem_pool.kv_cache_spec import STATE_RING, KVCacheSpec  # noqa: E402
from mem_pool.req_to_token_pool import ReqToTokenPool  # noqa: E402
from tiny_model import prompts, tiny_model  # noqa: E402

PAGE = 128                 # the smallest page both pools take with a ratio-128 layer
MAX_CTX = 512
FULL_PAGES = SWA_PAGES = 12
MAX_REQS = 4
TORCH = Options(kernel=KernelOptions(backend="torch"))


@pytest.fixture(scope="module")
def model():
    install_cpu_context()
    return tiny_model(MAX_CTX, seed=5)


class Side:
    """A pool the model runs over, its allocator and request table, stepped by hand as an
    engine steps: take(prompt lengths) -> extend batch; grow() -> decode batch."""

    def __init__(self, model_pool, allocator, req_to_token, slots, sglang: bool):
        self.pool, self.allocator, self.r2t = model_pool, allocator, req_to_token
        self.slots, self.sglang, self.lens = slots, sglang, []

    def _cpu(self, values):
        return torch.tensor(values, dtype=torch.int64)

    def take(self, lens):
        n, zeros = sum(lens), self._cpu([0] * len(lens))
        args = (zeros, zeros, self._cpu(lens), self._cpu(lens)) if self.sglang else (
            zeros, self._cpu(lens))
        locs = self.allocator.alloc_extend(*args, self._cpu([-1] * len(lens)), n)
        start = 0
        for slot, length in zip(self.slots, lens):
            self.r2t[slot, :length] = locs[start:start + length].to(torch.int32)
            start += length
        self.lens = list(lens)
        return locs

    def grow(self):
        self.lens = [n + 1 for n in self.lens]
        seq, last = self._cpu(self.lens), self._cpu(
            [int(self.r2t[s, n - 2]) for s, n in zip(self.slots, self.lens)])
        locs = (self.allocator.alloc_decode(seq, seq, last) if self.sglang else
                self.allocator.alloc_decode(seq, last))
        for slot, n, loc in zip(self.slots, self.lens, locs.tolist()):
            self.r2t[slot, n - 1] = loc
        return locs

    def state_rows(self, layer, slot, positions, swa):
        """{table: the state rows of (slot, positions)} (swa: the positions' SWA slots), by the
        pool's own addressing: ours, slot * ring + position % ring; SGLang's, its state pools'
        translations (a C4 ring per SWA page, a C128 ring per request slot)."""
        if not self.sglang:
            ring = STATE_RING[model_ratio(self.pool, layer)]
            rows = slot * ring + positions % ring
            return {"state": rows, "indexer_state": rows}
        pool = self.pool.pool
        states = {"state": pool.get_attention_compress_states(layer)}
        if pool.indexer_compress_state_pools[layer] is not None:
            states["indexer_state"] = pool.get_indexer_compress_states(layer)
        return {name: (st.translate_from_req_position_to_state_loc(
                           torch.full_like(positions, slot), positions.clone())
                       if st.request_scoped else st.translate_from_swa_loc_to_state_loc(swa.clone()))
                for name, st in states.items()}


def model_ratio(pool, layer):
    return pool.spec.compress_ratios[layer]


def our_side(model, n):
    cfg = model.config
    spec = KVCacheSpec(compress_ratios=cfg.compress_ratios[:cfg.n_layers],
                       window_size=cfg.window_size)
    pool, allocator = create_dsv4_kv_cache(spec, FULL_PAGES * PAGE, SWA_PAGES * PAGE, PAGE,
                                           max_num_reqs=MAX_REQS + 1)
    r2t = ReqToTokenPool(MAX_REQS, MAX_CTX)
    return Side(pool, allocator, r2t.req_to_token, [r2t.alloc() for _ in range(n)], False)


def sglang_side(model, n):
    """SGLang's pool sized as its pool configurator sizes one, its allocator (which registers
    the full -> SWA mapping) and request table; a first request of 300 tokens takes pages first,
    so the two sides' locations differ."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool as SGLangReqToTokenPool

    ratios = tuple(model.config.compress_ratios[:model.config.n_layers])
    pool = make_pool(swa_pages=SWA_PAGES, page_size=PAGE, layers=ratios,
                     full_tokens=FULL_PAGES * PAGE, max_num_reqs=MAX_REQS)
    for layer, ratio in enumerate(ratios):     # never written rows: NaN (the sentinel stays)
        if ratio == 4:
            for states in (pool.get_attention_compress_states(layer),
                           pool.get_indexer_compress_states(layer)):
                states.kv_score_buffer.kv_score[:-1] = float("nan")
    allocator = SWATokenToKVPoolAllocator(FULL_PAGES * PAGE, SWA_PAGES * PAGE, PAGE,
                                          torch.float8_e4m3fn, "cpu", pool, need_sort=False)
    r2t = SGLangReqToTokenPool(MAX_REQS, MAX_CTX, "cpu", False)
    slots = r2t.alloc_rows(n + 1)
    side = Side(SGLangMonoPool(pool, ratios), allocator, r2t.req_to_token, slots[:1], True)
    side.take([300])
    side.slots = slots[1:]
    return side


def extend_batch(tokens, locs, side):
    lens = side.lens
    return ForwardBatch(
        ForwardMode.EXTEND, input_ids=torch.tensor([t for p in tokens for t in p]),
        positions=torch.cat([torch.arange(n) for n in lens]), out_cache_loc=locs.long(),
        req_pool_indices=torch.tensor(side.slots), seq_lens=torch.tensor(lens),
        extend_seq_lens=torch.tensor(lens), max_seq_len=max(lens),
        host_positions=[p for n in lens for p in range(n)])


def padded_decode_batch(next_ids, locs, side):
    """A captured step's inputs: the requests' rows, then one padded row (request 0, location 0,
    position 0, length 1); no host positions."""
    lens = side.lens
    return ForwardBatch(
        ForwardMode.DECODE, input_ids=torch.tensor(next_ids + [0]),
        positions=torch.tensor([n - 1 for n in lens] + [0]),
        out_cache_loc=torch.cat([locs.long(), torch.zeros(1, dtype=torch.long)]),
        req_pool_indices=torch.tensor(side.slots + [0]), seq_lens=torch.tensor(lens + [1]))


def run(model, side, prompt_lens, steps, options, seed=0):
    """Logits of the extend and of each decode step (fed the given tokens), fp32."""
    ps = prompts(prompt_lens, seed)
    locs = side.take(prompt_lens)
    out = [model(extend_batch(ps, locs, side), side.pool, side.r2t, options=options)]
    g = torch.Generator().manual_seed(seed + 1)
    max_rows = model.static_max_rows(MAX_CTX)
    for _ in range(steps):
        ids = torch.randint(2, model.config.vocab_size, (len(prompt_lens),), generator=g).tolist()
        locs = side.grow()
        logits = model(padded_decode_batch(ids, locs, side), side.pool, side.r2t,
                       max_rows=max_rows, options=options)
        out.append(logits[:len(prompt_lens)])
    return out


def rows_by_position(side, layer, ratio):
    """Every KV and state row the side holds for its requests, keyed by (request, what,
    position), as bytes."""
    pool, got = side.pool, {}
    for i, (slot, n) in enumerate(zip(side.slots, side.lens)):
        locs = side.r2t[slot, :n].long()
        swa = pool.full_to_swa_index_mapping[locs]
        values, scales = read_kv_bytes(pool.get_swa_cache(layer), swa, PAGE)
        for p in range(n):
            got[i, "swa", p] = (values[p], scales[p])
        if not ratio:
            continue
        c_loc = locs[::ratio][:n // ratio] // ratio
        page = pool.compressed_page_size(layer)
        values, scales = read_kv_bytes(pool.get_compressed_cache(layer), c_loc, page)
        for c in range(c_loc.shape[0]):
            got[i, f"c{ratio}", c] = (values[c], scales[c])
        ring = STATE_RING[ratio]
        positions = torch.arange(max(0, n - ring), n)
        tables = [("state", pool.get_compressor_state(layer))]
        if ratio == 4:
            cache = pool.get_indexer_cache(layer)
            pg, off = c_loc // page, c_loc % page
            for c in range(c_loc.shape[0]):
                got[i, "indexer", c] = (
                    cache[pg[c], off[c] * INDEX_DIM:(off[c] + 1) * INDEX_DIM],
                    cache[pg[c], page * INDEX_DIM + off[c] * 4:page * INDEX_DIM + off[c] * 4 + 4])
            tables.append(("indexer_state", pool.get_indexer_compressor_state(layer)))
        rows = side.state_rows(layer, slot, positions, swa[positions])
        for name, table in tables:
            flat = table.view(-1, table.shape[-1])
            for p, row in zip(positions.tolist(), rows[name].tolist()):
                got[i, name, p] = (flat[row].view(torch.int32),)
    return got


def assert_same_kv(model, ours, theirs):
    for layer, ratio in enumerate(model.config.compress_ratios[:model.config.n_layers]):
        want, got = rows_by_position(ours, layer, ratio), rows_by_position(theirs, layer, ratio)
        assert want.keys() == got.keys(), layer
        for key, rows in want.items():
            for w, g in zip(rows, got[key]):
                assert torch.equal(w, g), (layer, key)


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


def test_a_decode_planned_by_the_triton_kernel_addresses_sglangs_rings(model, monkeypatch):
    """The decode steps' plans on attention_plan's Triton kernel (interpreted on a CPU; every
    other op and the extend's plan on torch): the same logits and bytes as over our pool."""
    pytest.importorskip("triton")
    plan_module = importlib.import_module("hip_kernels.attention_plan")
    ours, theirs = our_side(model, 1), sglang_side(model, 1)
    want = run(model, ours, [125], 4, TORCH)
    ran, real_op = set(), plan_module.op

    def recorded_op(name, backend):
        ran.add(backend)
        return real_op(name, backend)

    monkeypatch.setattr(plan_module, "resolve",
                        lambda op, device, backend, triton_ok=True: "triton" if triton_ok
                        else "torch")
    monkeypatch.setattr(plan_module, "op", recorded_op)
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
    with pytest.raises(ValueError, match="preshuffled"):
        SGLangMonoPool(pool, ratios)
    monkeypatch.undo()
    pool.swa_page_size = pool.swa_kv_pool.page_size = PAGE // 2
    with pytest.raises(ValueError, match=f"SWA page size {PAGE // 2} differs from its page size"):
        SGLangMonoPool(pool, ratios)
