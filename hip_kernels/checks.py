"""Argument checks shared by every set-KV op: each failure names the argument and what was
expected, and happens before any cache byte is written."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from .capture import is_capturing
from .kv_layout import TOKEN_BYTES, page_bytes
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions

LOC_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t, *, dtype=None, dtypes=None, dim=None, shape=None,
                 device=None, last_contiguous=False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = dtypes or ((dtype,) if dtype is not None else None)
    if allowed and t.dtype not in allowed:
        want = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != ts for s, ts in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if last_contiguous and t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got {t.stride()}")


def check_page_size(page_size, name: str = "page_size") -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"{name} must be an int >= 1, got {page_size!r}")


def check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def check_cache(name: str, cache, row_bytes: int, page_size: int, device) -> None:
    check_tensor(name, cache, dtype=torch.uint8, dim=2, device=device)
    if cache.shape[1] != row_bytes:
        raise ValueError(f"{name} page stride is {cache.shape[1]} bytes but page_size={page_size} "
                         f"needs {row_bytes}: page-size mismatch")
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_kv_cache(name: str, cache, page_size: int, device) -> None:
    """A V4-layout cache: contiguous [pages, page_bytes(page_size)], or [pages, page_size * 584]
    (the used bytes of each page) with unit inner stride and pages stride(0) bytes apart."""
    check_page_size(page_size)
    check_tensor(name, cache, dtype=torch.uint8, dim=2, device=device)
    padded, used = page_bytes(page_size), page_size * TOKEN_BYTES
    if cache.is_contiguous() and cache.shape[1] == padded:
        return
    if cache.shape[1] == used and cache.stride(1) == 1 and cache.stride(0) >= used:
        return
    if cache.shape[1] not in (padded, used):
        raise ValueError(f"{name} has {cache.shape[1]} bytes per page but page_size={page_size} "
                         f"needs {padded} (or a view of the {used} used bytes of each page): "
                         "page-size mismatch")
    raise ValueError(f"{name} with {cache.shape[1]} bytes per page must be contiguous, or a view "
                     f"of the {used} used bytes with unit inner stride and pages at least {used} "
                     f"bytes apart; got strides {cache.stride()}")


_trust = threading.local()


@contextmanager
def trusted_locations() -> Iterator[None]:
    """Inside, the caller vouches that every location and position was range-checked where it
    was handed out (an allocator that checks, an engine that builds positions from lengths): the
    per-op range checks, one host read each, are skipped. Kernels still mask slots past the
    cache, so a wrong location can never write outside it."""
    depth = getattr(_trust, "depth", 0)
    _trust.depth = depth + 1
    try:
        yield
    finally:
        _trust.depth = depth


def value_checks_enabled(kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> bool:
    """Range checks read tensor values on the host: skipped inside graph capture, inside
    `trusted_locations()`, and when kernel.value_checks is False (eager decode on a GPU then
    avoids one sync per op)."""
    return (not getattr(_trust, "depth", 0) and not is_capturing()
            and kernel.value_checks)


def check_finite(name: str, t: torch.Tensor,
                 kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> None:
    """With kernel.refuse_nonfinite, refuse a NaN or inf in t [N, ...] (one host read;
    skipped inside graph capture, where such input is stored poisoned)."""
    if t.numel() == 0 or is_capturing() or not kernel.refuse_nonfinite:
        return
    bad_rows = ~torch.isfinite(t).reshape(t.shape[0], -1).all(dim=1)
    first = torch.where(bad_rows, torch.arange(t.shape[0], device=t.device), t.shape[0]).min()
    row = int(first)
    if row < t.shape[0]:
        raise ValueError(f"{name} row {row} holds a NaN or inf (refuse_nonfinite=True refuses "
                         "non-finite K/V; with False it is stored as NaN bytes)")


def check_kernel(kernel) -> KernelOptions:
    if not isinstance(kernel, KernelOptions):
        raise TypeError(f"kernel must be a hip_kernels.KernelOptions, got "
                        f"{type(kernel).__name__}")
    return kernel


def check_locations(name: str, loc, n: int, capacity: int, device,
                    kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> None:
    """loc: [n] int32/int64 on device; values < capacity (negative = skip), no slot >= 1 twice.
    The value checks need one host sync: see value_checks_enabled()."""
    check_tensor(name, loc, dtypes=LOC_DTYPES, shape=(n,), device=device)
    if n and value_checks_enabled(kernel):
        check_slot_values(name, loc, capacity)


def check_positions(positions, n: int, max_pos: int, device,
                    kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> None:
    """positions: [n] int32/int64 on device, each a row of a RoPE table of max_pos rows: kernels
    read freqs_cis[positions] unchecked (the range check is a host sync: see
    value_checks_enabled())."""
    check_tensor("positions", positions, dtypes=LOC_DTYPES, shape=(n,), device=device)
    if positions.numel() and value_checks_enabled(kernel):
        lo, hi = torch.stack(torch.aminmax(positions)).tolist()
        if lo < 0 or hi >= max_pos:
            raise IndexError(f"positions holds {lo if lo < 0 else hi} but freqs_cis has {max_pos} "
                             f"rows (valid: 0..{max_pos - 1})")


def check_slot_values(name: str, slots, capacity: int,
                      range_message: str | None = None) -> None:
    """Slots below capacity, and each slot >= 1 at most once: two rows writing one slot would
    leave backend-dependent bytes (GPU programs race); slot 0, the dummy that padded rows share,
    may repeat. One host read for both checks. range_message may use {hi}, the largest slot."""
    s = slots.sort().values
    if s.numel() > 1:
        twice = (s[1:] == s[:-1]) & (s[1:] > 0)
        first_twice = torch.where(twice, s[1:], torch.zeros_like(s[1:])).max()  # 0: none
    else:
        first_twice = torch.zeros_like(s[:1])[0]
    hi, dup = torch.stack([s[-1], first_twice]).tolist()
    if hi >= capacity:
        raise IndexError(range_message.format(hi=hi) if range_message else (
            f"{name} holds location {hi} but the cache has {capacity} slots (valid: -1 to skip, "
            f"or 0..{capacity - 1})"))
    if dup > 0:
        raise ValueError(f"{name} holds slot {dup} {int((slots == dup).sum())} times: each slot "
                         ">= 1 may be written by one row only (0, the dummy, may repeat)")
