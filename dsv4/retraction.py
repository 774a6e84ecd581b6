"""Retract a running request when the pool runs out, and resume it later with identical output.

Retraction copies the request's KV rows (SWA, compressed, indexer) and its compressor state rings
to the host (`pool.get_cpu_copy` with its request slot), then frees its pages and slot. Resuming
allocates fresh pages for the same number of tokens (same in-page offsets: the request starts on a
page boundary), frees the SWA pages that had already left the window (so the copy's SWA rows and
the new slots line up), and loads the copy back (`pool.load_cpu_copy`).
"""

from __future__ import annotations

import torch

from .request import Request


def retract(engine, req: Request) -> None:
    locs = engine.req_to_token[req.slot, :req.seq_len].long()
    req.host_copy = engine.pool.get_cpu_copy(locs, req_pool_idx=req.slot)
    engine.allocator.free(locs.cpu())
    engine.req_to_token_pool.free(req.slot)
    req.slot = None


def try_resume(engine, req: Request) -> bool:
    """Give req its KV back; False (with nothing taken) when slots or pages are short."""
    if engine.req_to_token_pool.available() == 0:
        return False
    n = torch.tensor([req.seq_len])
    locs = engine.allocator.alloc_extend(torch.zeros_like(n), n, torch.full_like(n, -1),
                                         req.seq_len)
    if locs is None:
        return False
    req.slot = engine.req_to_token_pool.alloc()
    engine.req_to_token_pool.write(req.slot, 0, locs)
    engine.allocator.free_swa_out_of_window(locs.cpu(), req.seq_len,
                                            engine.model.config.window_size)
    engine.pool.load_cpu_copy(req.host_copy, locs, req_pool_idx=req.slot)
    req.host_copy = None
    return True
