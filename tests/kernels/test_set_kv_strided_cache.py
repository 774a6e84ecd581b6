"""Every set-KV store written through a strided view of a cache (pages further apart than
page_bytes(P), as a host engine may hand them) gets the bytes a contiguous cache gets, and no byte
outside the used part of a page changes."""

import importlib.util

import pytest
import torch

import hip_kernels
from hip_kernels import KernelOptions
from hip_kernels import kv_layout as L
from hip_kernels.backend import resolve
from hip_kernels.platform import OCP, default_device
from kv_inputs import (SENTINEL, bf16_rows, clone_args, gen, kv_cache, norm_rope_args, same_bytes,
                       to_device)

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
if "triton" in BACKENDS:
    from triton_interp_shim import interpreter_shim  # noqa: F401 (autouse fixture)

DEV = default_device()

P, PAGES = 4, 3
GAP = 2 * L.VALUE_BYTES + 16      # pages lie page_bytes(P) + GAP bytes apart: not a 576 multiple
USED = P * L.TOKEN_BYTES          # the bytes of a page the layout uses
# The first and the last slot of every page, one more in the middle and a skipped row (-1). (The
# translating store reserves SWA slot 0 for "unmapped": its row for slot 0 goes to slot 1.)
SLOTS = torch.tensor([0, 3, 4, 7, 8, 11, 5, -1, 10])
STORE_OPS = ("fused_store_cache", "store_kv_pack", "fused_k_norm_rope_store",
             "fused_translate_norm_rope_store")


def store_args(op: str, seed: int = 5) -> dict:
    """Keyword arguments of `op` (cache left out) writing len(SLOTS) rows at SLOTS (OCP fp8)."""
    g, n = gen(seed), len(SLOTS)
    if op == "fused_store_cache":
        return dict(rows=bf16_rows(g, n, L.HEAD_DIM, pad=64), out_loc=SLOTS, page_size=P)
    if op == "store_kv_pack":
        nope, rope, scales = L.quantize_kv_rows(bf16_rows(g, n, L.HEAD_DIM), OCP)
        return dict(nope_fp8=nope, rope_bf16=rope, scales=scales, out_loc=SLOTS, page_size=P)
    args = norm_rope_args(seed, n, P, PAGES, heads=2 if op == "fused_k_norm_rope_store" else 0)
    del args["cache"]
    if op == "fused_k_norm_rope_store":
        args["out_loc"] = SLOTS
        return args
    # The translating store: full locations mapped onto SLOTS, slot 0 replaced by 1.
    del args["out_loc"]
    swa = torch.where(SLOTS == 0, torch.ones_like(SLOTS), SLOTS)
    full = torch.tensor([6, 2, 9, 0, 12, 14, 1, -1, 3])
    full_to_swa = torch.zeros(16, dtype=torch.int64)
    full_to_swa[full[full >= 0]] = swa[full >= 0]
    args.update(full_loc=full, full_to_swa=full_to_swa)
    return args


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", STORE_OPS)
def test_a_strided_cache_view_gets_the_bytes_of_a_contiguous_cache_and_no_gap_byte(
        backend, op):
    """A host engine may hand a view of the used P*584 bytes of pages that lie further apart
    than page_bytes(P). Written through such a view, every page holds byte for byte what a
    contiguous cache holds after the same call, and no byte after the used part of a page (its
    padding and the gap to the next page) changes. Locations on every page, at both ends of
    each, make a wrong page stride or a wrong scale offset visible. (test_set_kv_store_numerics
    covers fused_k_norm_rope_store without a norm weight this way; this covers every store.)"""
    kernel = KernelOptions(backend=backend, fp8_dialect=OCP)
    assert resolve(op, DEV, backend, hip_ok=False) == backend
    args = store_args(op)
    dense = to_device(dict(clone_args(args), cache=kv_cache(PAGES, P)), DEV)
    getattr(hip_kernels, op)(**dense, kernel=kernel)
    base = torch.full((PAGES, L.page_bytes(P) + GAP), SENTINEL, dtype=torch.uint8, device=DEV)
    view = base[:, :USED]
    assert not view.is_contiguous() and view.stride(0) == L.page_bytes(P) + GAP
    strided = to_device(dict(clone_args(args), cache=view), DEV)
    getattr(hip_kernels, op)(**strided, kernel=kernel)
    dense_cache, base = dense["cache"].cpu(), base.cpu()
    assert (dense_cache[:, :USED] != SENTINEL).any(1).all()     # rows landed on every page
    assert same_bytes(base[:, :USED], dense_cache[:, :USED])
    assert (base[:, USED:] == SENTINEL).all()
    for key in ("q", "swa_loc_out"):
        if dense.get(key) is not None:
            assert same_bytes(strided[key].cpu(), dense[key].cpu())
