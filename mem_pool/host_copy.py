"""Host (CPU) copies of a request's KV, for retraction and offload, loadable into other slots.

Rows are copied by field (value bytes and scale bytes at their own offsets), so a load into
different pages and in-page offsets is byte-exact. Which locations carry a row:
- SWA: locations with an SWA slot (full_to_swa > 0, the swa_mask);
- C4 / indexer: locations with loc % 4 == 3 (the token that completes a compressed row), row
  loc // 4; C128 likewise with 128.
A load checks every mask of the new locations against the saved one before writing anything;
a disagreement raises naming the rows, so nothing is silently dropped or left as garbage.
Compressor state rings are per request: copied when req_pool_idx is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hip_kernels import kv_layout
from hip_kernels.capture import is_capturing

from .loc_checks import check_loc_tensor, check_range


@dataclass
class HostRows:
    """One cache family: which copied locations carry a row, and each layer's row bytes."""
    mask: torch.Tensor                                   # [num_tokens] bool
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class KVHostCopy:
    num_tokens: int
    families: dict[str, HostRows]                        # swa, c4, indexer, c128
    states: dict[str, dict[int, torch.Tensor]] | None    # per state table: layer -> [ring, width]


def _read_rows(family: str, cache: torch.Tensor, rows: torch.Tensor, page_size: int):
    if family == "indexer":
        values, scales = kv_layout.indexer_byte_index(rows, page_size)
        flat = cache.view(-1)
        return flat[values], flat[scales]
    return kv_layout.read_kv_bytes(cache, rows, page_size)


def _write_rows(family: str, cache: torch.Tensor, rows: torch.Tensor, page_size: int,
                values: torch.Tensor, scales: torch.Tensor) -> None:
    if family == "indexer":
        value_at, scale_at = kv_layout.indexer_byte_index(rows, page_size)
        flat = cache.view(-1)
        flat[value_at.flatten()] = values.flatten()
        flat[scale_at.flatten()] = scales.flatten()
    else:
        kv_layout.write_kv_bytes(cache, rows, page_size, values, scales)


def _family_rows(pool, indices: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per family the pool holds: (mask over indices, cache rows of the masked indices)."""
    swa_slot = pool.full_to_swa_index_mapping[indices]
    out = {"swa": (swa_slot > 0, swa_slot[swa_slot > 0])}
    for family, ratio in (("c4", 4), ("indexer", 4), ("c128", 128)):
        if _tables(pool)[family][0]:
            mask = indices % ratio == ratio - 1
            out[family] = (mask, indices[mask] // ratio)
    return out


def _tables(pool) -> dict[str, tuple[dict[int, torch.Tensor], int]]:
    return {"swa": (pool.swa_caches, pool.page_size), "c4": (pool.c4_caches, pool.c4_page_size),
            "indexer": (pool.indexer_caches, pool.c4_page_size),
            "c128": (pool.c128_caches, pool.c128_page_size)}


def _state_tables(pool) -> dict[str, dict[int, torch.Tensor]]:
    return {"compressor_state": pool.compressor_states,
            "indexer_compressor_state": pool.indexer_compressor_states}


def _check_indices(pool, name: str, indices) -> torch.Tensor:
    if is_capturing():
        raise RuntimeError("host copies synchronize with the host: not allowed during capture")
    mapping = pool.registered_mapping()
    check_loc_tensor(name, indices, mapping.device)
    if indices.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
    indices = indices.to(torch.int64)
    check_range(name, indices.cpu(), 0, mapping.numel() - 1)
    return indices


def _check_req(pool, name: str, req_pool_idx: int) -> None:
    if not 0 <= req_pool_idx < pool.max_num_reqs:
        raise IndexError(f"{name}={req_pool_idx}; valid request slots are "
                         f"0..{pool.max_num_reqs - 1}")


def get_cpu_copy(pool, indices: torch.Tensor, req_pool_idx: int | None = None) -> KVHostCopy:
    """Copy the rows of full locations `indices` (and the state of req_pool_idx) to the host."""
    indices = _check_indices(pool, "indices", indices)
    families = {}
    for family, (mask, rows) in _family_rows(pool, indices).items():
        table, page_size = _tables(pool)[family]
        families[family] = HostRows(mask.cpu(), {
            layer: tuple(t.cpu() for t in _read_rows(family, cache, rows, page_size))
            for layer, cache in table.items()})
    states = None
    if req_pool_idx is not None:
        _check_req(pool, "req_pool_idx", req_pool_idx)
        states = {name: {layer: s[req_pool_idx].cpu() for layer, s in table.items()}
                  for name, table in _state_tables(pool).items()}
    return KVHostCopy(indices.numel(), families, states)


def _disagreement(family: str, saved: torch.Tensor, new: torch.Tensor) -> str:
    rows = torch.nonzero(saved != new).flatten()
    shown = rows[:8].tolist()
    more = f" and {rows.numel() - len(shown)} more" if rows.numel() > len(shown) else ""
    what = "an SWA slot" if family == "swa" else f"a {family} row"
    return (f"load_cpu_copy: the {family} mask of the new indices disagrees with the copy at "
            f"rows {shown}{more} (a row has {what} on one side only)")


def _check_same_layers(what: str, saved: dict, held: dict) -> None:
    if set(saved) != set(held):
        raise ValueError(f"load_cpu_copy: the copy's {what} layers {sorted(saved)} are not this "
                         f"pool's {sorted(held)}")


def load_cpu_copy(pool, copy: KVHostCopy, indices: torch.Tensor,
                  req_pool_idx: int | None = None) -> None:
    """Write a host copy at new full locations `indices` (and request slot req_pool_idx).
    Everything is checked before the first byte is written."""
    indices = _check_indices(pool, "indices", indices)
    if indices.numel() != copy.num_tokens:
        raise ValueError(f"indices has {indices.numel()} locations but the copy holds "
                         f"{copy.num_tokens}")
    targets = _family_rows(pool, indices)
    if set(copy.families) != set(targets):
        raise ValueError(f"load_cpu_copy: the copy holds caches {sorted(copy.families)}, this "
                         f"pool {sorted(targets)}")
    for family, (mask, _) in targets.items():
        saved = copy.families[family]
        _check_same_layers(family, saved.layers, _tables(pool)[family][0])
        if not torch.equal(saved.mask, mask.cpu()):
            raise ValueError(_disagreement(family, saved.mask, mask.cpu()))
    if (copy.states is None) != (req_pool_idx is None):
        raise ValueError("load_cpu_copy: pass req_pool_idx exactly when the copy holds "
                         f"compressor state (it {'does not' if copy.states is None else 'does'})")
    if req_pool_idx is not None:
        _check_req(pool, "req_pool_idx", req_pool_idx)
        for name, table in _state_tables(pool).items():
            _check_same_layers(name, copy.states[name], table)
    for family, (_, rows) in targets.items():
        table, page_size = _tables(pool)[family]
        for layer, (values, scales) in copy.families[family].layers.items():
            _write_rows(family, table[layer], rows, page_size, values.to(pool.device),
                        scales.to(pool.device))
    if copy.states is not None:
        for name, table in _state_tables(pool).items():
            for layer, state in table.items():
                state[req_pool_idx].copy_(copy.states[name][layer])
