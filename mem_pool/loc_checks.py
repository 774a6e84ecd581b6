"""Argument checks shared by the allocators and pools.

Each failure names the argument and what was expected, and happens before any state changes.
"""

from __future__ import annotations

from typing import Sequence

import torch

LOC_DTYPES = (torch.int32, torch.int64)


def host_int64(name: str, value: torch.Tensor | Sequence[int] | int) -> torch.Tensor:
    """`value` as a 1-D int64 CPU tensor (a device tensor costs one host sync)."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in LOC_DTYPES:
            raise TypeError(f"{name} must have dtype torch.int32 or torch.int64, got {value.dtype}")
        t = value.detach().to("cpu", torch.int64)
    else:
        t = torch.as_tensor(value, dtype=torch.int64)
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t


def host_ints(name: str, value: torch.Tensor | Sequence[int]) -> list[int]:
    """`value` (1-D) as a list of ints: a list of ints as it is, a tensor read once (a device
    tensor costs one host sync)."""
    if isinstance(value, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return host_int64(name, value).tolist()


def check_loc_tensor(name: str, loc, device: torch.device) -> None:
    """A location tensor: int32/int64, on `device`."""
    if not isinstance(loc, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(loc).__name__}")
    if loc.dtype not in LOC_DTYPES:
        raise TypeError(f"{name} must have dtype torch.int32 or torch.int64, got {loc.dtype}")
    if loc.device != device:
        raise ValueError(f"{name} must be on {device}, got {loc.device}")


def check_range(name: str, values: torch.Tensor, low: int, high: int) -> None:
    """Every value in [low, high); `values` is a CPU tensor."""
    if values.numel() == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < low or hi >= high:
        bad = lo if lo < low else hi
        raise IndexError(f"{name} holds {bad}; valid values are {low}..{high - 1}")


def whole_pages(name: str, locs: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pages of `locs` (CPU int64), which must cover each of its pages completely.

    Raises naming `name` when a page is only partly covered or a location repeats."""
    if torch.unique(locs).numel() != locs.numel():
        raise ValueError(f"{name} must not repeat a location")
    pages, counts = torch.unique(locs // page_size, return_counts=True)
    partial = counts != page_size
    if partial.any():
        page, count = int(pages[partial][0]), int(counts[partial][0])
        raise ValueError(f"{name} must cover whole pages of page_size={page_size}: page {page} "
                         f"has {count} of its {page_size} locations")
    return pages
