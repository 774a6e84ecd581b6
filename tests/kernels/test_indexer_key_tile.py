"""The indexer cache's two key orders (`kv_layout.INDEX_KEY_TILES`): 0, row-major; 16, keys in
16 x 16 tiles. With tile 16 every writer puts each key byte where an independent encoder (a
reshape and a permute of the row-major page, not the code's offset formula) says, the scale
block is the row-major one, and every reader (the torch dequantizer, the scores ops on both
backends) reads the same keys, bit for bit, as from a row-major cache holding them. A tile
that is not 0 or 16, or a page that is not a whole number of tiles, is refused by name before
any byte is written.
"""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import KernelOptions, set_kv  # noqa: E402
from hip_kernels import kv_layout as L  # noqa: E402
from hip_kernels import platform as P  # noqa: E402
from hip_kernels.indexer_scores import indexer_scores, indexer_scores_shared  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

PAGE = 32
PAGES = 4
SLOTS = PAGE * PAGES
TILE = 16
DEV = default_device()
BACKENDS = ("torch", "triton")


def kernel_for(backend: str, dialect: str = "ocp") -> KernelOptions:
    return KernelOptions(backend=backend, fp8_dialect=P.DIALECTS[dialect])


def keys(seed: int, n: int = SLOTS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, L.INDEX_DIM, generator=g) * 10 ** (torch.rand(n, 1, generator=g) - 1)
    return k.to(torch.bfloat16)


def empty_cache() -> torch.Tensor:
    return torch.zeros(PAGES, L.indexer_page_bytes(PAGE), dtype=torch.uint8, device=DEV)


def stored(k: torch.Tensor, loc: torch.Tensor, key_tile: int, backend: str,
           dialect: str = "ocp") -> torch.Tensor:
    """A cache with k stored at loc by the store op, keys in key_tile's order."""
    cache = empty_cache()
    set_kv.indexer_store(k.to(DEV), cache, loc.to(DEV), PAGE, pow2_scale=True, key_tile=key_tile,
                         kernel=kernel_for(backend, dialect))
    return cache.cpu()


def tiled_from_row_major(cache: torch.Tensor) -> torch.Tensor:
    """The independent encoder: each page's row-major value block [P, 128] viewed as [slot
    block, slot in block, dim block, dim in block] and laid out slot block, dim block, slot in
    block, dim in block (16 x 16 tiles, each row-major); the scale block as it is."""
    values = cache[:, :PAGE * L.INDEX_DIM].reshape(PAGES, PAGE // TILE, TILE,
                                                   L.INDEX_DIM // TILE, TILE)
    out = cache.clone()
    out[:, :PAGE * L.INDEX_DIM] = values.permute(0, 1, 3, 2, 4).reshape(PAGES, -1)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tiled_store_puts_each_byte_where_the_tiles_say(backend):
    loc = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(1))[:SLOTS - 9]
    k = keys(2, loc.numel())
    row_major = stored(k, loc, 0, "torch")
    tiled = stored(k, loc, TILE, backend)
    assert tiled[:, :PAGE * L.INDEX_DIM].any()
    assert torch.equal(tiled, tiled_from_row_major(row_major))
    assert torch.equal(tiled[:, PAGE * L.INDEX_DIM:], row_major[:, PAGE * L.INDEX_DIM:])


def test_the_offset_of_one_byte():
    """Slot 37 of its page, dim 70: slot block 2, dim block 4, slot 5 and dim 6 within."""
    off = L.indexer_value_offset(torch.tensor(37), torch.tensor(70), TILE)
    assert int(off) == 2 * 16 * 128 + 4 * 16 * 16 + 5 * 16 + 6
    assert int(L.indexer_value_offset(torch.tensor(37), torch.tensor(70))) == 37 * 128 + 70


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dialect", ("fnuz", "ocp"))
def test_a_tiled_cache_reads_back_the_row_major_keys(backend, dialect):
    k = keys(3)
    loc = torch.arange(SLOTS)
    want = L.read_indexer_rows(stored(k, loc, 0, "torch", dialect), loc, PAGE,
                               P.DIALECTS[dialect])
    tiled = stored(k, loc, TILE, backend, dialect)
    order = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(4)).view(8, -1)
    got = L.read_indexer_rows(tiled, order, PAGE, P.DIALECTS[dialect], TILE)
    assert torch.equal(got.view(torch.int32), want[order].view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("w_dtype", (torch.bfloat16, torch.float32))
def test_the_scores_over_tiles_are_the_row_major_scores(backend, w_dtype):
    g = torch.Generator().manual_seed(5)
    k = keys(6)
    loc_all = torch.arange(SLOTS)
    caches = {tile: stored(k, loc_all, tile, "torch").to(DEV) for tile in (0, TILE)}
    n, heads, c = 3, 16, 70
    q = torch.randn(n, heads, L.INDEX_DIM, generator=g).bfloat16().to(DEV)
    w = (torch.randn(n, heads, generator=g) * (L.INDEX_DIM * heads) ** -0.5).to(w_dtype).to(DEV)
    valid = (torch.rand(n, c, generator=g) > 0.2).to(DEV)
    loc = torch.where(valid.cpu(), torch.randint(0, SLOTS, (n, c), generator=g), 0).to(DEV)
    kernel = kernel_for(backend)
    per_query = {tile: indexer_scores(q, w, caches[tile], loc, valid, PAGE, weight_scale=0.5,
                                      key_tile=tile, kernel=kernel) for tile in caches}
    assert torch.isfinite(per_query[0][valid]).all()
    assert torch.equal(per_query[TILE].cpu(), per_query[0].cpu())
    shared = {tile: indexer_scores_shared(q, w, caches[tile], loc[0], valid, PAGE,
                                          weight_scale=0.5, key_tile=tile, kernel=kernel)
              for tile in caches}
    assert torch.equal(shared[TILE].cpu(), shared[0].cpu())


BAD = [(8, PAGE, "key_tile"), (True, PAGE, "key_tile"), (TILE, 8, "page_size"),
       (TILE, 40, "page_size")]


@pytest.mark.parametrize("key_tile, page_size, name", BAD)
def test_a_bad_tile_or_page_is_refused_by_name(key_tile, page_size, name):
    with pytest.raises(ValueError, match=name):
        L.check_key_tile(key_tile, page_size)


@pytest.mark.parametrize("key_tile, name", [(8, "key_tile"), (TILE, "page_size")])
def test_every_op_refuses_before_writing(key_tile, name):
    page = 8                                   # not a whole number of 16-slot tiles
    cache = torch.zeros(2, L.indexer_page_bytes(page), dtype=torch.uint8)
    loc = torch.arange(4)
    with pytest.raises(ValueError, match=name):
        set_kv.indexer_store(keys(7, 4), cache, loc, page, key_tile=key_tile)
    with pytest.raises(ValueError, match=name):
        L.write_indexer_bytes(cache, loc, page, torch.zeros(4, L.INDEX_DIM).to(
            torch.float8_e4m3fn), torch.ones(4), key_tile)
    assert not cache.any()
    with pytest.raises(ValueError, match=name):
        L.read_indexer_rows(cache, loc, page, P.DIALECTS["ocp"], key_tile)
    q = torch.zeros(1, 16, L.INDEX_DIM)
    w = torch.zeros(1, 16)
    valid = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=name):
        indexer_scores(q, w, cache, loc[None], valid, page, key_tile=key_tile)
    with pytest.raises(ValueError, match=name):
        indexer_scores_shared(q, w, cache, loc, valid, page, key_tile=key_tile)
