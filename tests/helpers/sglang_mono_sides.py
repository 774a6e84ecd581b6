"""Our model stepped by hand over two pools, as an engine steps it: this project's pool, and SGLang
0.5.23's DeepSeekV4TokenToKVPool seen through `SGLangMonoPool`; and every KV and state row each
side holds, by (request, position), to compare them byte for byte.

Each side has its own allocator (SGLang's SWATokenToKVPoolAllocator and ReqToTokenPool; ours),
so requests hold other request slots and other locations on each side: rows are read at each
side's locations, and the compressor state rows through each side's addressing (SGLang: a C4
ring per SWA page, a C128 ring per request slot; ours: a ring per request slot). SGLang's C4
rings start as `torch.empty`; here every row but its empty sentinel starts as NaN, so a row read
before its request wrote it would show in the logits. An indexer key is compared in dim order,
read from its page by the side's key order (`indexer_key_bytes`).
"""

import torch

from dsv4.forward_batch import ForwardBatch, ForwardMode
from dsv4.options import Options
from dsv4.plugins.sglang_mono_pool import SGLangMonoPool
from hip_kernels import KernelOptions
from hip_kernels.kv_layout import INDEX_DIM, read_kv_bytes
from mem_pool.dsv4_pool import create_dsv4_kv_cache
from mem_pool.kv_cache_spec import STATE_RING, KVCacheSpec
from mem_pool.req_to_token_pool import ReqToTokenPool
from sglang_host import make_pool
from tiny_model import prompts

PAGE = 128                 # the smallest page both pools take with a ratio-128 layer
MAX_CTX = 512
FULL_PAGES = SWA_PAGES = 12
MAX_REQS = 4
TORCH = Options(kernel=KernelOptions(backend="torch"))


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
    side.r2t_pool = r2t
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


def indexer_key_bytes(cache, page, off, page_size, tile):
    """(the 128 payload bytes of slot off of page, in dim order; its 4 scale bytes). tile 0: the
    payload row by row; 16: SGLang's preshuffled 16 x 16 tiles, dim d of slot o at
    (o // 16) * 2048 + (d // 16) * 256 + (o % 16) * 16 + d % 16 (as SGLang's indexer stores
    write it: its Triton `_set_k_and_s_triton_kernel` and fused_norm_rope_v2.cuh)."""
    d = torch.arange(INDEX_DIM)
    at = (off * INDEX_DIM + d if not tile else
          (off // tile) * (tile * INDEX_DIM) + (d // tile) * tile * tile + (off % tile) * tile
          + d % tile)
    scale = page_size * INDEX_DIM + off * 4
    return cache[page, at], cache[page, scale:scale + 4]


def rows_by_position(side, layer, ratio, key_tile=None):
    """Every KV and state row the side holds for its requests, keyed by (request, what,
    position), as bytes; indexer keys read in the pool's key order (``indexer_key_tile``), or
    in key_tile's if given."""
    pool, got = side.pool, {}
    tile = pool.indexer_key_tile if key_tile is None else key_tile
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
            for c in range(c_loc.shape[0]):
                got[i, "indexer", c] = indexer_key_bytes(cache, int(c_loc[c]) // page,
                                                         int(c_loc[c]) % page, page, tile)
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
