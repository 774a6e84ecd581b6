"""The per-step full->SWA translation cache, keyed by the identity of the location tensor.

Every layer of a decode step writes its window KV at the SWA slots of the same `out_cache_loc`,
so the translation (a gather through the mapping) is computed once and reused. An entry is
reused only when nothing that could change the answer has changed:

- the location tensor's memory and view: data_ptr (not the storage's: views at different
  offsets differ), numel, shape, strides, dtype, device;
- its contents: the in-place version counter (a static buffer refilled in place);
- the mapping: the pool's generation (every allocator mutation), plus the mapping tensor's own
  address and version counter (a second pool sharing the mapping, or a writer that bypassed the
  allocator through torch ops);
- whether a graph is being captured (an entry from a warm-up run must not let the capture skip
  the gather, and a tensor from a capture is not reused eagerly).

The tensor most recently served has a fast path: when the very same tensor object comes back
with the same address, version and mapping state (the other layers of a step), the hit costs a
few attribute reads instead of building the key.

Entries hold a reference to the keyed tensor, so its memory cannot be recycled for the next
batch while cached, and the result's version is checked so a caller that modified the returned
tensor gets a fresh one. Tensors without a version counter (created under torch.inference_mode)
are translated on every call: freshness cannot be proven for them.

What it sees and what it cannot: every in-place torch op on the location tensor or the mapping
(`copy_`, `fill_`, indexing assignment, `index_put_`, out= ops) bumps the tensor's version counter
and so misses. Writes that bypass the counter are invisible: through `tensor.data`, through a
numpy view (`tensor.numpy()`), through another framework's view of the memory (DLPack), or by a
custom kernel writing the memory. After such a write call `invalidate()` (the pool's
`invalidate_loc_cache()`). A cache made with `swa_cache_verify=True` (DSV4_SWA_CACHE_VERIFY=1)
recomputes every hit and raises `StaleSwaLocError` on a stale one (a host sync per hit; never
inside graph capture).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from hip_kernels.capture import is_capturing

from . import envs

logger = logging.getLogger(__name__)


class StaleSwaLocError(RuntimeError):
    """A cached translation no longer matches the mapping (found with swa_cache_verify=True)."""


@dataclass
class SwaLocStats:
    translations: int = 0   # gathers run (cache misses, cache off, direct translations)
    hits: int = 0
    misses: int = 0

    def reset(self) -> None:
        self.translations = self.hits = self.misses = 0


@dataclass
class _Entry:
    loc: torch.Tensor        # held so its memory is not recycled while cached
    swa_loc: torch.Tensor
    swa_loc_version: int
    mapping_state: tuple


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


class SwaLocCache:
    """A small LRU of translations (>= 2 entries, so interleaved micro-batches do not thrash).

    cache_swa_translation: cache translations (False: translate on every call).
    swa_cache_verify: recompute every hit and raise StaleSwaLocError on a stale one. None reads
    DSV4_CACHE_SWA_TRANSLATION / DSV4_SWA_CACHE_VERIFY, once, here: both are fixed for the
    cache's life (`enabled`, `verify`)."""

    def __init__(self, stats: SwaLocStats, capacity: int = 4, *,
                 cache_swa_translation: bool | None = None,
                 swa_cache_verify: bool | None = None):
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2 (two micro-batches interleave), got "
                             f"{capacity}")
        self.stats = stats
        self.capacity = capacity
        self.enabled = _flag_value("cache_swa_translation", cache_swa_translation,
                                   envs.CACHE_SWA_TRANSLATION)
        self.verify = _flag_value("swa_cache_verify", swa_cache_verify, envs.SWA_CACHE_VERIFY)
        self.generation = 0
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._warned_unversioned = False
        self._last: tuple | None = None     # the fast path: see last_hit

    def bump_generation(self) -> None:
        self.generation += 1

    def invalidate(self) -> None:
        """Drop every entry (idempotent)."""
        self._entries.clear()
        self._last = None

    def last_hit(self, loc: torch.Tensor) -> torch.Tensor | None:
        """The cached translation when loc is the very tensor served last and nothing in its
        key can have changed (same checks as get, on the remembered values); else None."""
        last = self._last
        if last is None or loc is not last[0]:
            return None
        _, version, ptr, mapping, mapping_version, generation, capturing, swa_loc, \
            swa_version = last
        if (loc._version != version or loc.data_ptr() != ptr or mapping._version != mapping_version
                or self.generation != generation or swa_loc._version != swa_version
                or is_capturing() != capturing):
            return None
        self.stats.hits += 1
        return swa_loc

    def _remember(self, loc, mapping, mapping_state, entry: _Entry) -> None:
        """Serve loc by last_hit from now on (not while every hit must be verified)."""
        if self.verify:
            self._last = None
            return
        self._last = (loc, loc._version, loc.data_ptr(), mapping, mapping._version,
                      mapping_state[2], mapping_state[3], entry.swa_loc, entry.swa_loc_version)

    def get(self, loc: torch.Tensor, mapping: torch.Tensor,
            translate: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The translation of loc: cached when provably fresh, else translate(loc)."""
        if not self.enabled:
            return translate(loc)
        loc_version = _version(loc)
        if loc_version is None:
            self._warn_unversioned()
            self.stats.misses += 1
            return translate(loc)
        mapping_state = (mapping.data_ptr(), mapping._version, self.generation, is_capturing())
        key = (loc.data_ptr(), loc.numel(), tuple(loc.shape), loc.stride(), loc.dtype,
               loc.device, loc_version) + mapping_state
        entry = self._entries.get(key)
        if entry is not None and entry.swa_loc._version == entry.swa_loc_version:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            if self.verify and not is_capturing():
                _verify(loc, mapping, entry.swa_loc)
            self._remember(loc, mapping, mapping_state, entry)
            return entry.swa_loc
        self.stats.misses += 1
        with torch.inference_mode(False):  # the result needs a version counter
            swa_loc = translate(loc)
        self._drop_stale(mapping_state)
        self._entries[key] = entry = _Entry(loc, swa_loc, swa_loc._version, mapping_state)
        self._remember(loc, mapping, mapping_state, entry)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return swa_loc

    def _drop_stale(self, mapping_state: tuple) -> None:
        """Entries of an older mapping state can never hit again: release their tensors."""
        for key in [k for k, e in self._entries.items() if e.mapping_state != mapping_state]:
            del self._entries[key]
        self._last = None

    def _warn_unversioned(self) -> None:
        if not self._warned_unversioned:
            self._warned_unversioned = True
            logger.warning("SWA location cache: a location tensor created under "
                           "torch.inference_mode has no version counter; it is translated on "
                           "every call. Create out_cache_loc outside inference_mode (or under "
                           "torch.no_grad) to cache its translation.")


def _flag_value(name: str, value: bool | None, flag) -> bool:
    if value is None:
        return flag.get()
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, or None to read {flag.name}, got {value!r}")
    return value


def _verify(loc: torch.Tensor, mapping: torch.Tensor, cached: torch.Tensor) -> None:
    fresh = mapping[loc.long()].to(cached.dtype)
    if not torch.equal(fresh, cached):
        bad = (fresh != cached).nonzero().flatten()[:4].tolist()
        raise StaleSwaLocError(
            f"SWA location cache: a cached translation is stale at positions {bad} (cached "
            f"{cached[bad].tolist()}, now {fresh[bad].tolist()}): the location tensor or the "
            "mapping was written without bumping its version counter (through .data, a numpy "
            "view or a custom kernel); call invalidate_loc_cache() after such writes")
