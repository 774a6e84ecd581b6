"""A host pool's `get_cached_swa_loc(raw_loc, layer_id)` served by our identity-keyed cache.

Older SGLang pools (the 0.5.12 line) translate full -> SWA locations once per forward with the
rule "recompute when layer_id == start_layer", which goes stale when a forward does not begin at
that layer (draft pools, pipeline stages), when micro-batches interleave, or when the mapping
changes mid-forward. The replacement keys each translation by the identity of the location
tensor, its version counter, the mapping tensor's address and version counter, and whether a
graph is being captured (so a warm-up run never lets a capture skip the gather); `layer_id` is
accepted and never used. The cache lives on the pool instance.
"""

from __future__ import annotations

from mem_pool.swa_loc_cache import SwaLocCache, SwaLocStats


def swa_loc_cache_of(pool) -> SwaLocCache:
    """The pool's translation cache (created on first use; its `stats` count hits/translations)."""
    cache = pool.__dict__.get("_dsv4_swa_loc_cache")
    if cache is None:
        cache = pool.__dict__["_dsv4_swa_loc_cache"] = SwaLocCache(SwaLocStats())
    return cache


def cached_swa_loc_hook(original, self, raw_loc, layer_id):
    cache = swa_loc_cache_of(self)

    def translate(loc):
        cache.stats.translations += 1
        return self.translate_loc_from_full_to_swa(loc)

    return cache.get(raw_loc, self.full_to_swa_index_mapping, translate)
