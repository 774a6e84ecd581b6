"""Retract a running request when the pool runs out, and resume it later with identical output.

Retraction copies the request's KV rows (SWA, compressed, indexer) and its compressor state rings
to the host (``KVSlots.host_copy``), then frees its pages and slot. Resuming takes fresh pages for
the same number of tokens (same in-page offsets: the request starts on a page boundary) and a
slot, frees the SWA pages that had already left the window (so the copy's SWA rows and the new
slots line up), and loads the copy back (``KVSlots.load_host_copy``).
"""

from __future__ import annotations

from .kv_slots import KVSlots
from .request import Request


def retract(slots: KVSlots, req: Request) -> None:
    req.host_copy = slots.host_copy(req)
    slots.release(req)


def try_resume(slots: KVSlots, req: Request) -> bool:
    """Give req its KV back; False (with nothing taken) when slots or pages are short."""
    if slots.take([req], [req.seq_len]) is None:
        return False
    slots.release_out_of_window(req, req.seq_len)
    slots.load_host_copy(req, req.host_copy)
    req.host_copy = None
    return True
