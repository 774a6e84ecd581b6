"""Retract a running request when the pool runs out, and resume it later with identical output.

Retraction copies the request's KV rows (SWA, compressed, indexer) and its compressor state rings
to the host (`pool.get_cpu_copy` with its request slot), then frees its pages and slot. Resuming
allocates fresh pages for the same number of tokens (same in-page offsets: the request starts on a
page boundary), frees the SWA pages that had already left the window (so the copy's SWA rows and
the new slots line up), and loads the copy back (`pool.load_cpu_copy`).
"""

from __future__ import annotations

import torch

from mem_pool.swa_window import pages_out_of_window

from .request import Request


def retract(engine, req: Request) -> None:
    locs = torch.tensor(req.locs, dtype=torch.int64)
    req.host_copy = engine.pool.get_cpu_copy(locs.to(engine.device), req_pool_idx=req.slot)
    engine.allocator.free(locs)
    engine.req_to_token_pool.free(req.slot)
    req.slot, req.locs = None, []


def try_resume(engine, req: Request) -> bool:
    """Give req its KV back; False (with nothing taken) when slots or pages are short."""
    if engine.req_to_token_pool.available() == 0:
        return False
    n = torch.tensor([req.seq_len])
    locs = engine.allocator.alloc_extend(torch.zeros_like(n), n, torch.full_like(n, -1),
                                         req.seq_len)
    if locs is None:
        return False
    req.locs = engine.allocator.last_handed_out.tolist()
    req.slot = engine.req_to_token_pool.alloc()
    engine.req_to_token_pool.write(req.slot, 0, locs)
    window = engine.model.config.window_size
    engine.allocator.free_swa_out_of_window(torch.tensor(req.locs), req.seq_len, window)
    req.swa_freed_to = pages_out_of_window(req.seq_len, window, engine.page_size) * engine.page_size
    engine.pool.load_cpu_copy(req.host_copy, locs, req_pool_idx=req.slot)
    req.host_copy = None
    return True
