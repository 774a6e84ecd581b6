"""One cached page of KV as a flat dict of named tensors (a page record), and back.

A KVHostCopy of n * page_size positions splits into n records, page by page, and records join
back into a KVHostCopy byte for byte. Entry names:

    kv/<family>/mask               bool [page_size]: the positions of the page that carry a row
    kv/<family>/<layer>/values     uint8 [rows, value bytes]: the page's rows, in position order
    kv/<family>/<layer>/scales     uint8 [rows, scale bytes]
    state/<table>/<layer>          optional, opaque: compressor state after the page's last token

Families and layers are whatever the copy holds (swa, c4, indexer, c128). The state entries
describe the boundary at the END of their page: splitting puts a copy's state (the state after
its last token) into the last record, and joining takes the last record's state (a record
inside the joined span describes a boundary the joined copy does not end at, so its state is
left out). A record serializes with safetensors (`record_to_bytes` / `record_from_bytes`).
"""

from __future__ import annotations

from typing import Sequence

import safetensors.torch
import torch

from ..host_copy import HostRows, KVHostCopy

PageRecord = dict[str, torch.Tensor]
KV, STATE = "kv", "state"


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A compact copy: safetensors refuses tensors that share storage."""
    return t.detach().cpu().clone()


def _family_counts(family: str, rows: HostRows, num_tokens: int, num_pages: int,
                   page_size: int) -> list[int]:
    if rows.mask.dtype != torch.bool or rows.mask.shape != (num_tokens,):
        raise ValueError(f"the {family} mask must be bool [{num_tokens}], got "
                         f"{rows.mask.dtype} {tuple(rows.mask.shape)}")
    total = int(rows.mask.sum())
    for layer, (values, scales) in rows.layers.items():
        if values.shape[0] != total or scales.shape[0] != total:
            raise ValueError(f"{family} layer {layer} holds {values.shape[0]} value and "
                             f"{scales.shape[0]} scale rows; its mask marks {total}")
    return rows.mask.view(num_pages, page_size).sum(1).tolist()


def split_host_copy(copy: KVHostCopy, page_size: int) -> list[PageRecord]:
    """Per-page records of a copy of whole pages (copy.num_tokens a multiple of page_size)."""
    if page_size < 1 or copy.num_tokens % page_size:
        raise ValueError(f"the copy holds {copy.num_tokens} positions: not a whole number of "
                         f"pages of page_size={page_size}")
    num_pages = copy.num_tokens // page_size
    if num_pages == 0 and copy.states is not None:
        raise ValueError("a copy of no positions has no page to carry its compressor state")
    records: list[PageRecord] = [{} for _ in range(num_pages)]
    for family, rows in copy.families.items():
        counts = _family_counts(family, rows, copy.num_tokens, num_pages, page_size)
        start = 0
        for page, (record, count) in enumerate(zip(records, counts)):
            record[f"{KV}/{family}/mask"] = _clone(rows.mask[page * page_size:
                                                             (page + 1) * page_size])
            for layer, (values, scales) in rows.layers.items():
                record[f"{KV}/{family}/{layer}/values"] = _clone(values[start:start + count])
                record[f"{KV}/{family}/{layer}/scales"] = _clone(scales[start:start + count])
            start += count
    if copy.states is not None:
        records[-1] = with_boundary_state(records[-1], copy.states)
    return records


def boundary_state(record: PageRecord) -> dict[str, dict[int, torch.Tensor]] | None:
    """The compressor state after the record's last token, or None when it has none."""
    states: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in record.items():
        parts = name.split("/")
        if parts[0] == STATE:
            states.setdefault(parts[1], {})[int(parts[2])] = tensor
    return states or None


def with_boundary_state(record: PageRecord,
                        states: dict[str, dict[int, torch.Tensor]] | None) -> PageRecord:
    """A new record: `record`'s KV entries with `states` (None: none) as its boundary state."""
    out = {name: t for name, t in record.items() if not name.startswith(STATE + "/")}
    for table, layers in (states or {}).items():
        if "/" in table:
            raise ValueError(f"state table name {table!r} must not contain '/'")
        for layer, tensor in layers.items():
            out[f"{STATE}/{table}/{int(layer)}"] = _clone(tensor)
    return out


def _kv_layout(record: PageRecord, where: str) -> dict[str, set[int]]:
    """family -> layers of a record's KV entries; checks the names are well formed."""
    layout: dict[str, set[int]] = {}
    for name in record:
        parts = name.split("/")
        if parts[0] == STATE and len(parts) == 3:
            continue
        if parts[0] != KV or len(parts) not in (3, 4) or parts[-1] not in (
                ("mask",) if len(parts) == 3 else ("values", "scales")):
            raise ValueError(f"{where}: {name!r} is not a page record entry")
        layers = layout.setdefault(parts[1], set())
        if len(parts) == 4:
            layers.add(int(parts[2]))
    for family in layout:
        if f"{KV}/{family}/mask" not in record:
            raise ValueError(f"{where}: family {family} has rows but no mask")
    return layout


def record_page_size(record: PageRecord) -> int:
    """The number of positions a record covers (the length of its masks)."""
    sizes = {record[f"{KV}/{f}/mask"].numel() for f in _kv_layout(record, "record")}
    if len(sizes) != 1:
        raise ValueError(f"a record's masks must have one length, got {sorted(sizes)}")
    return sizes.pop()


def join_page_records(records: Sequence[PageRecord]) -> KVHostCopy:
    """The KVHostCopy of consecutive pages' records (state: the last record's, if any)."""
    if not records:
        raise ValueError("join_page_records needs at least one record")
    layout = _kv_layout(records[0], "record 0")
    page_size = record_page_size(records[0])
    for i, record in enumerate(records[1:], 1):
        if _kv_layout(record, f"record {i}") != layout:
            raise ValueError(f"record {i} holds other families or layers than record 0")
        if record_page_size(record) != page_size:
            raise ValueError(f"record {i} covers {record_page_size(record)} positions, record 0 "
                             f"{page_size}")
    families = {}
    for family, layers in layout.items():
        masks = [r[f"{KV}/{family}/mask"] for r in records]
        joined = {}
        for layer in sorted(layers):
            parts = [(r[f"{KV}/{family}/{layer}/values"], r[f"{KV}/{family}/{layer}/scales"])
                     for r in records]
            for i, (mask, (values, scales)) in enumerate(zip(masks, parts)):
                if values.shape[0] != int(mask.sum()) or scales.shape[0] != int(mask.sum()):
                    raise ValueError(f"record {i}: {family} layer {layer} rows do not match "
                                     "its mask")
            joined[layer] = (torch.cat([v for v, _ in parts]), torch.cat([s for _, s in parts]))
        families[family] = HostRows(torch.cat(masks), joined)
    return KVHostCopy(page_size * len(records), families, boundary_state(records[-1]))


def record_to_bytes(record: PageRecord) -> bytes:
    """The record in the safetensors format."""
    return safetensors.torch.save({name: t.contiguous() for name, t in record.items()})


def record_from_bytes(data: bytes) -> PageRecord:
    """A record from `record_to_bytes` output (raises on bytes that are not safetensors)."""
    return dict(safetensors.torch.load(data))
