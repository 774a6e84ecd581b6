"""The DeepSeek-V4 KV pool: SWA, C4, C128 and indexer caches, compressor state rings, and the
full->SWA translation with its identity-keyed cache (see swa_loc_cache.py).

Layer ids are global (a pipeline stage holds spec.start_layer..spec.end_layer-1). Page 0 of every
paged cache, SWA slot 0 and request slot 0 are dummies that padded graph rows write to; state
ring row `max_num_reqs` is the scratch row that request index -1 lands on. Every state ring is a
request slot's (`state_ring_swa_page` is empty: no ratio's rings go by SWA page). The indexer
caches hold their keys row-major (`indexer_key_tile` 0, see `hip_kernels.kv_layout`).

The pool holds the buffers; the KV rows a step stores are written by the set-KV kernels of
hip_kernels, given a layer's cache (`get_swa_cache(layer_id)`), the slots and `page_size`.
"""

from __future__ import annotations

import logging

import torch

from hip_kernels import indexer_page_bytes, page_bytes
from hip_kernels.capture import is_capturing
from hip_kernels.checks import value_checks_enabled

from . import host_copy
from .kv_cache_spec import ATTN_STATE_WIDTH, INDEXER_STATE_WIDTH, STATE_RING, KVCacheSpec
from .loc_checks import check_loc_tensor
from .swa_allocator import SWATokenToKVPoolAllocator
from .swa_loc_cache import SwaLocCache, SwaLocStats

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_REQS = 256


class DeepSeekV4TokenToKVPool:
    def __init__(self, spec: KVCacheSpec, max_total_tokens: int, swa_tokens: int, page_size: int,
                 device: torch.device | str = "cpu", max_num_reqs: int | None = None, *,
                 cache_swa_translation: bool | None = None, swa_cache_verify: bool | None = None):
        """cache_swa_translation, swa_cache_verify: the SWA location cache's switches (see
        SwaLocCache); None reads DSV4_CACHE_SWA_TRANSLATION / DSV4_SWA_CACHE_VERIFY once, here."""
        spec.check_page_size(page_size)
        for name, n in (("max_total_tokens", max_total_tokens), ("swa_tokens", swa_tokens)):
            if n < page_size or n % page_size:
                raise ValueError(f"{name}={n} must be a positive multiple of "
                                 f"page_size={page_size}")
        if max_num_reqs is None:  # a running request holds at least one full page
            max_num_reqs = min(DEFAULT_MAX_NUM_REQS, max_total_tokens // page_size)
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be >= 1, got {max_num_reqs}")
        self.spec = spec
        self.size = max_total_tokens
        self.size_swa = swa_tokens
        self.page_size = page_size
        self.max_num_reqs = max_num_reqs
        self.device = torch.device(device)
        self.start_layer, self.end_layer = spec.start_layer, spec.end_layer
        self.c4_page_size = page_size // 4
        self.c128_page_size = page_size // 128
        full_pages, swa_pages = max_total_tokens // page_size + 1, swa_tokens // page_size + 1
        c4, c128 = spec.layers_with_ratio(4), spec.layers_with_ratio(128)
        with torch.inference_mode(False):  # usable in and out of inference mode
            self.swa_caches = {i: self._bytes(swa_pages, page_bytes(page_size))
                               for i in spec.layer_ids}
            self.c4_caches = {i: self._bytes(full_pages, page_bytes(self.c4_page_size))
                              for i in c4}
            self.indexer_caches = {i: self._bytes(full_pages, indexer_page_bytes(self.c4_page_size))
                                   for i in c4}
            self.c128_caches = {i: self._bytes(full_pages, page_bytes(self.c128_page_size))
                                for i in c128}
            self.compressor_states = {i: self._state(STATE_RING[spec.compress_ratios[i]],
                                                     ATTN_STATE_WIDTH[spec.compress_ratios[i]])
                                      for i in c4 + c128}
            self.indexer_compressor_states = {i: self._state(STATE_RING[4], INDEXER_STATE_WIDTH)
                                              for i in c4}
        self.state_ring_swa_page: dict[int, int] = {}   # ratio -> SWA page size of its rings
        self.indexer_key_tile = 0                          # indexer keys row-major
        self.full_to_swa_index_mapping: torch.Tensor | None = None
        self.swa_loc_stats = SwaLocStats()
        self._loc_cache = SwaLocCache(self.swa_loc_stats,
                                      cache_swa_translation=cache_swa_translation,
                                      swa_cache_verify=swa_cache_verify)
        logger.info("DeepSeek-V4 KV pool: layers %d..%d, %d full + %d SWA tokens, page %d, "
                    "%d request slots, %.2f GiB", self.start_layer, self.end_layer - 1,
                    max_total_tokens, swa_tokens, page_size, max_num_reqs, self.nbytes / 2**30)

    def _bytes(self, pages: int, row_bytes: int) -> torch.Tensor:
        return torch.zeros(pages, row_bytes, dtype=torch.uint8, device=self.device)

    def _state(self, ring: int, width: int) -> torch.Tensor:
        state = torch.zeros(self.max_num_reqs + 1, ring, width, dtype=torch.float32,
                            device=self.device)
        state[:, :, width // 2:] = float("-inf")
        return state

    def all_buffers(self) -> dict[str, dict[int, torch.Tensor]]:
        return {"swa": self.swa_caches, "c4": self.c4_caches, "indexer": self.indexer_caches,
                "c128": self.c128_caches, "compressor_state": self.compressor_states,
                "indexer_compressor_state": self.indexer_compressor_states}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for table in self.all_buffers().values() for t in table.values())

    # ---- layers ---------------------------------------------------------------------------

    def layer_ratio(self, layer_id: int) -> int:
        self._check_layer(layer_id)
        return self.spec.compress_ratios[layer_id]

    def _check_layer(self, layer_id: int) -> None:
        if layer_id not in self.spec.layer_ids:
            raise ValueError(f"layer_id={layer_id} is not held by this pool (layers "
                             f"{self.start_layer}..{self.end_layer - 1})")

    def _lookup(self, table: dict, layer_id: int, what: str) -> torch.Tensor:
        if layer_id in table:
            return table[layer_id]
        raise ValueError(f"layer_id={layer_id} has compress ratio {self.layer_ratio(layer_id)}: "
                         f"it has no {what}")

    def get_swa_cache(self, layer_id: int) -> torch.Tensor:
        return self._lookup(self.swa_caches, layer_id, "SWA cache")

    def get_compressed_cache(self, layer_id: int) -> torch.Tensor:
        """The C4 or C128 cache, by the layer's compress ratio."""
        table = {4: self.c4_caches, 128: self.c128_caches}.get(self.layer_ratio(layer_id), {})
        return self._lookup(table, layer_id, "compressed cache")

    def compressed_page_size(self, layer_id: int) -> int:
        """Rows per page of the layer's compressed cache (page_size // ratio)."""
        self.get_compressed_cache(layer_id)
        return self.page_size // self.spec.compress_ratios[layer_id]

    def get_indexer_cache(self, layer_id: int) -> torch.Tensor:
        return self._lookup(self.indexer_caches, layer_id, "indexer cache (ratio-4 layers only)")

    def get_compressor_state(self, layer_id: int) -> torch.Tensor:
        """[max_num_reqs + 1, ring, width] fp32, [kv | score] halves, indexed by req_pool_idx."""
        return self._lookup(self.compressor_states, layer_id,
                            "compressor state (ratio-4 and ratio-128 layers only)")

    def get_indexer_compressor_state(self, layer_id: int) -> torch.Tensor:
        return self._lookup(self.indexer_compressor_states, layer_id,
                            "indexer compressor state (ratio-4 layers only)")

    def clear_compressor_state(self, req_pool_indices) -> None:
        """Reset the state rings of these request slots: kv 0, score -inf."""
        idx = torch.as_tensor(req_pool_indices, device=self.device)
        check_loc_tensor("req_pool_indices", idx, self.device)
        idx = idx.flatten().to(torch.int64)
        if idx.numel() and not is_capturing():
            lo, hi = torch.aminmax(idx)
            if int(lo) < 0 or int(hi) >= self.max_num_reqs:
                raise IndexError(f"req_pool_indices holds {int(lo) if int(lo) < 0 else int(hi)}; "
                                 f"valid request slots are 0..{self.max_num_reqs - 1}")
        for table in (self.compressor_states, self.indexer_compressor_states):
            for state in table.values():
                half = state.shape[-1] // 2
                state[:, :, :half].index_fill_(0, idx, 0.0)
                state[:, :, half:].index_fill_(0, idx, float("-inf"))

    # ---- full -> SWA translation ----------------------------------------------------------

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """Use this mapping (the allocator's); its storage must stay the same from now on."""
        m = full_to_swa_index_mapping
        want = (self.size // self.page_size + 1) * self.page_size + 1
        if not isinstance(m, torch.Tensor) or m.dtype != torch.int64 or m.shape != (want,):
            raise ValueError(f"full_to_swa_index_mapping must be an int64 tensor of shape "
                             f"({want},) = max_total_tokens + page_size + 1 with page_size="
                             f"{self.page_size}, got {getattr(m, 'dtype', type(m))} "
                             f"{tuple(getattr(m, 'shape', ()))}")
        if m.device != self.device or m.is_inference():
            raise ValueError(f"full_to_swa_index_mapping must be on {self.device} and not an "
                             "inference tensor (its in-place updates must be versioned)")
        if int(m[-1]) != -1:
            raise ValueError("full_to_swa_index_mapping must end with -1 (so -1 translates to -1)")
        self.full_to_swa_index_mapping = m
        self.bump_mapping_generation()

    @property
    def mapping_generation(self) -> int:
        return self._loc_cache.generation

    def bump_mapping_generation(self) -> None:
        """Called on every mapping mutation: cached translations become unreachable."""
        self._loc_cache.bump_generation()

    def invalidate_loc_cache(self) -> None:
        """Drop every cached translation (idempotent; a no-op before any mapping exists)."""
        self._loc_cache.invalidate()

    def registered_mapping(self) -> torch.Tensor:
        """The full->SWA mapping; raises when no allocator registered one."""
        if self.full_to_swa_index_mapping is None:
            raise RuntimeError("no full->SWA mapping registered: create the pool with "
                               "create_dsv4_kv_cache (the allocator registers its mapping)")
        return self.full_to_swa_index_mapping

    def _translate(self, loc: torch.Tensor) -> torch.Tensor:
        mapping = self.full_to_swa_index_mapping
        if loc.numel() and value_checks_enabled():
            lo, hi = (int(v) for v in torch.stack(torch.aminmax(loc)).tolist())
            if lo < -1 or hi >= mapping.numel() - 1:
                raise IndexError(f"loc holds {lo if lo < -1 else hi}; valid full-pool locations "
                                 f"are 0..{mapping.numel() - 2}, or -1 for none")
        self.swa_loc_stats.translations += 1
        return mapping[loc].to(torch.int32)

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """int32 SWA slots of full locations (0 = no SWA slot, -1 for -1); never cached."""
        check_loc_tensor("loc", loc, self.registered_mapping().device)
        return self._translate(loc)

    def get_cached_swa_loc(self, loc: torch.Tensor, layer_id: int | None = None) -> torch.Tensor:
        """As translate_loc_from_full_to_swa, computed once per location tensor and mapping
        state. layer_id is accepted for call-site compatibility; it never decides freshness."""
        hit = self._loc_cache.last_hit(loc)
        if hit is not None:
            return hit
        mapping = self.registered_mapping()
        check_loc_tensor("loc", loc, mapping.device)
        return self._loc_cache.get(loc, mapping, self._translate)

    # ---- host copies ----------------------------------------------------------------------

    def get_cpu_copy(self, indices: torch.Tensor, req_pool_idx: int | None = None):
        return host_copy.get_cpu_copy(self, indices, req_pool_idx)

    def load_cpu_copy(self, kv_cache_cpu, indices: torch.Tensor,
                      req_pool_idx: int | None = None) -> None:
        host_copy.load_cpu_copy(self, kv_cache_cpu, indices, req_pool_idx)


def create_dsv4_kv_cache(spec: KVCacheSpec, max_total_tokens: int, swa_tokens: int,
                         page_size: int, device: torch.device | str = "cpu", *,
                         max_num_reqs: int | None = None, cache_swa_translation: bool | None = None,
                         swa_cache_verify: bool | None = None):
    """(pool, allocator) for a spec: the allocator registers its mapping with the pool. The
    SWA location cache's switches as in DeepSeekV4TokenToKVPool (None: read the flag now)."""
    pool = DeepSeekV4TokenToKVPool(spec, max_total_tokens, swa_tokens, page_size, device,
                                   max_num_reqs, cache_swa_translation=cache_swa_translation,
                                   swa_cache_verify=swa_cache_verify)
    allocator = SWATokenToKVPoolAllocator(max_total_tokens, swa_tokens, page_size, pool, device)
    return pool, allocator
