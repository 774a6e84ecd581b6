"""SGLang's own writer of its preshuffled indexer keys against this project's tiled layout: SGLang
0.5.23's indexer store kernel (`_set_k_and_s_triton_kernel` in
`sglang.kernels.ops.kvcache.dsa_index_k_cache`, a Triton kernel: interpreted on a CPU) run with
the tile SGLang passes it when it preshuffles (`INDEXER_K_CACHE_PRESHUFFLE_TILE`), writes the
very bytes `kv_layout.write_indexer_bytes` writes with key tile 16 for the same fp8 keys and
scales; without the tile, the row-major bytes of key tile 0."""

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("sglang.kernels.ops.kvcache.dsa_index_k_cache",
                    reason="SGLang is not installed (see README)")

from hip_kernels import kv_layout as L  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

PAGE = 64                  # SGLang's indexer page (a C4 page of a 256-token page)
PAGES = 3


def sglang_store(loc, k, scale, tile):
    from sglang.kernels.ops.kvcache.dsa_index_k_cache import _set_k_and_s_triton_kernel

    buf = torch.zeros(PAGES, L.indexer_page_bytes(PAGE), dtype=torch.uint8)
    _set_k_and_s_triton_kernel[(loc.numel(),)](
        buf, buf.view(torch.float32), loc, k, scale, k.stride(0), PAGE_SIZE=PAGE,
        BUF_NUMEL_PER_PAGE=buf.shape[1], NUM_K_ELEMS_PER_TOKEN=L.INDEX_DIM,
        S_OFFSET_NBYTES_IN_PAGE=PAGE * L.INDEX_DIM, PRESHUFFLE_TILE=tile)
    return buf


def test_sglangs_preshuffled_store_writes_our_key_tile_16_bytes():
    from sglang.srt.layers.attention.dsa.utils import INDEXER_K_CACHE_PRESHUFFLE_TILE

    g = torch.Generator().manual_seed(0)
    n = PAGE * PAGES - 11
    loc = torch.randperm(PAGE * PAGES, generator=g)[:n]
    k = torch.randint(0, 256, (n, L.INDEX_DIM), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, generator=g)
    for sglang_tile, ours in ((INDEXER_K_CACHE_PRESHUFFLE_TILE, 16), (0, 0)):
        want = sglang_store(loc, k, scale, sglang_tile)
        got = torch.zeros_like(want)
        L.write_indexer_bytes(got, loc, PAGE, k.view(torch.float8_e4m3fn), scale, ours)
        assert want[:, :PAGE * L.INDEX_DIM].any() and torch.equal(got, want)
