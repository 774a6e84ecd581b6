"""64-bit byte offsets in the Triton set-KV kernels.

1. The offset helpers every kernel uses (`kv_value_offset`, `kv_scale_offset`, `indexer_offsets`
   in both key orders) are run in a tiny kernel on int32 and int64 locations whose offsets pass
   2^31 and 2^32.
2. The real kernels write rows past 2^32 bytes into a cache of more than 4 GiB that costs no
   memory: on a CPU it is an anonymous mmap (only the pages written to are ever backed).
"""

import mmap

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import hip_kernels  # noqa: E402
from hip_kernels import KernelOptions  # noqa: E402
from hip_kernels import kv_layout as L  # noqa: E402
from hip_kernels.platform import FNUZ, default_device  # noqa: E402
from hip_kernels.triton_kv_row import (indexer_offsets, kv_scale_offset,  # noqa: E402
                                       kv_value_offset)
from kv_inputs import bf16_rows, clone_args, gen, norm_rope_args, to_device  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

DEV = default_device()
TWO_31 = 2 ** 31
TWO_32 = 2 ** 32


@triton.jit
def offsets_kernel(loc_ptr, out_ptr, N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   PAGE_BYTES: tl.constexpr, KEY_TILE: tl.constexpr):
    i = tl.arange(0, N)
    loc = tl.load(loc_ptr + i)
    tl.store(out_ptr + i * 4, kv_value_offset(loc, PAGE_SIZE, PAGE_BYTES))
    tl.store(out_ptr + i * 4 + 1, kv_scale_offset(loc, PAGE_SIZE, PAGE_BYTES))
    value_off, scale_off = indexer_offsets(loc, PAGE_SIZE, KEY_TILE)
    tl.store(out_ptr + i * 4 + 2, value_off)
    tl.store(out_ptr + i * 4 + 3, scale_off)


def large_locations(page_size, dtype):
    """8 locations: small ones, the first pages past 2^31 and 2^32 bytes, and the largest."""
    pb = L.page_bytes(page_size)
    hi = 2 ** 31 - 1 if dtype == torch.int32 else 2 ** 40
    locs = [0, page_size - 1, (TWO_31 // pb + 1) * page_size, (TWO_31 // pb + 1) * page_size + 1,
            (TWO_32 // pb + 1) * page_size + page_size - 1, (TWO_31 // 132) + 3, hi - 1, hi]
    return torch.tensor(locs, dtype=dtype)


@pytest.mark.parametrize("page_size, key_tile", [(1, 0), (2, 0), (64, 0), (256, 0), (64, 16),
                                                 (256, 16)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_offset_helpers_are_64_bit(page_size, key_tile, dtype):
    loc = large_locations(page_size, dtype)
    out = torch.zeros(len(loc), 4, dtype=torch.int64, device=DEV)
    offsets_kernel[(1,)](loc.to(DEV), out, N=len(loc), PAGE_SIZE=page_size,
                         PAGE_BYTES=L.page_bytes(page_size), KEY_TILE=key_tile)
    got = out.cpu()
    l64 = loc.long()
    ibase = (l64 // page_size) * L.indexer_page_bytes(page_size)
    t = l64 % page_size
    key = (t // 16 * 16 * L.INDEX_DIM + t % 16 * 16) if key_tile else t * L.INDEX_DIM
    want = torch.stack([L.value_offset(loc, page_size), L.scale_offset(loc, page_size),
                        ibase + key, ibase + page_size * L.INDEX_DIM + t * 4], 1)
    assert (want.max() > TWO_32) and torch.equal(got, want)


def huge_zero_cache(page_size, min_bytes, page_bytes):
    """(keep-alive handle, zeroed uint8 cache [pages, page_bytes]) of more than min_bytes."""
    pages = min_bytes // page_bytes + 2
    if DEV.type != "cpu":
        return None, torch.zeros(pages, page_bytes, dtype=torch.uint8, device=DEV)
    try:
        buf = mmap.mmap(-1, pages * page_bytes)
    except (OSError, ValueError, OverflowError) as e:
        pytest.skip(f"cannot map {pages * page_bytes} bytes of virtual memory: {e}")
    return buf, torch.frombuffer(buf, dtype=torch.uint8).view(pages, page_bytes)


def written_pages(cache, loc, page_size):
    """The pages holding loc and their neighbours, copied out."""
    pages = sorted({p for l in loc.tolist() if l >= 0 for p in (l // page_size - 1, l // page_size,
                                                                  l // page_size + 1)})
    return {p: cache[p].cpu().clone() for p in pages if 0 <= p < cache.shape[0]}


def far_locations(page_size, page_bytes, capacity, dtype):
    """Rows just past 2^31 and 2^32 bytes, the last slot, a small one and a skipped one."""
    return torch.tensor([(TWO_31 // page_bytes + 1) * page_size + page_size // 2,
                         (TWO_32 // page_bytes + 1) * page_size, capacity - 1, 3, -1], dtype=dtype)


@pytest.mark.parametrize("op,loc_dtype", [("fused_k_norm_rope_store", torch.int32),
                                          ("indexer_store", torch.int64)])
def test_kernels_write_past_4gib(op, loc_dtype):
    page_size = 256 if op == "fused_k_norm_rope_store" else 64
    layout_bytes = L.page_bytes if op == "fused_k_norm_rope_store" else L.indexer_page_bytes
    page_bytes = layout_bytes(page_size)
    results = {}
    for backend in ("torch", "triton"):
        keep, cache = huge_zero_cache(page_size, TWO_32, page_bytes)
        loc = far_locations(page_size, page_bytes, cache.shape[0] * page_size, loc_dtype)
        if op == "fused_k_norm_rope_store":
            args = clone_args(norm_rope_args(5, len(loc), page_size, 2))
            args.update(cache=cache, out_loc=loc)
            args = to_device(args, DEV)
        else:
            args = dict(k=bf16_rows(gen(5), len(loc), L.INDEX_DIM).to(DEV), cache=cache,
                        out_loc=loc.to(DEV), page_size=page_size)
        getattr(hip_kernels, op)(**args, kernel=KernelOptions(backend=backend, fp8_dialect=FNUZ))
        results[backend] = written_pages(cache, loc, page_size)
        del keep, cache, args
    torch_pages, triton_pages = results["torch"], results["triton"]
    assert torch_pages.keys() == triton_pages.keys()
    assert max(torch_pages) * page_bytes > TWO_32
    for p in torch_pages:
        assert torch.equal(torch_pages[p], triton_pages[p]), f"page {p} differs"
    assert sum(int(t.count_nonzero()) for t in triton_pages.values()) > 0
