"""What the DeepSeek-V4 KV pool holds per layer, and how many bytes that takes.

Per layer of the pool's pipeline stage (global ids start_layer..end_layer-1):
- every layer: an SWA cache in the V4 FP8 layout, one page per SWA page;
- ratio-4 layers: a C4 cache (page = page_size/4 rows) and the indexer cache (132-byte layout,
  same page), plus compressor state rings (attention and indexer);
- ratio-128 layers: a C128 cache (page = page_size/128 rows) and a compressor state ring.
Compressed caches have one page per full page, so compressed row = full_loc // ratio.
State rings are fp32 [kv | score] rows, one ring per request slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from hip_kernels import kv_layout

RATIOS = (0, 4, 128)
STATE_RING = {4: 8, 128: 128}                      # ring rows per request
ATTN_STATE_WIDTH = {4: 2 * 2 * kv_layout.HEAD_DIM, 128: 2 * kv_layout.HEAD_DIM}
INDEXER_STATE_WIDTH = 2 * 2 * kv_layout.INDEX_DIM  # ratio-4 layers only
FP32_BYTES = 4


@dataclass(frozen=True)
class KVCacheSpec:
    compress_ratios: tuple[int, ...]
    window_size: int = 128
    head_dim: int = kv_layout.HEAD_DIM
    rope_head_dim: int = kv_layout.ROPE_DIM
    index_head_dim: int = kv_layout.INDEX_DIM
    start_layer: int = 0
    end_layer: int | None = None   # None = len(compress_ratios)

    def __post_init__(self) -> None:
        ratios = tuple(int(r) for r in self.compress_ratios)
        object.__setattr__(self, "compress_ratios", ratios)
        if self.end_layer is None:
            object.__setattr__(self, "end_layer", len(ratios))
        bad = sorted({r for r in ratios if r not in RATIOS})
        if bad:
            raise ValueError(f"compress_ratios entries must be in {RATIOS}, found {bad}")
        fixed = (("head_dim", kv_layout.HEAD_DIM), ("rope_head_dim", kv_layout.ROPE_DIM),
                 ("index_head_dim", kv_layout.INDEX_DIM))
        for name, want in fixed:
            if getattr(self, name) != want:
                raise ValueError(f"{name} must be {want} (fixed by the V4 cache layout), got "
                                 f"{getattr(self, name)}")
        if self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")
        if not 0 <= self.start_layer < self.end_layer <= len(ratios):
            raise ValueError(f"need 0 <= start_layer < end_layer <= len(compress_ratios)="
                             f"{len(ratios)}, got start_layer={self.start_layer}, "
                             f"end_layer={self.end_layer}")

    @property
    def layer_ids(self) -> range:
        """Global ids of the layers this pool holds."""
        return range(self.start_layer, self.end_layer)

    def layers_with_ratio(self, ratio: int) -> tuple[int, ...]:
        return tuple(i for i in self.layer_ids if self.compress_ratios[i] == ratio)

    def check_page_size(self, page_size: int) -> None:
        """page_size must split into whole compressed pages for every ratio held."""
        need = max([1] + [r for r in (4, 128) if self.layers_with_ratio(r)])
        if page_size < 1 or page_size % need:
            raise ValueError(f"page_size={page_size} must be a positive multiple of {need} "
                             f"(the largest compress ratio among layers {self.start_layer}.."
                             f"{self.end_layer - 1})")


@dataclass(frozen=True)
class CacheFootprint:
    """Bytes of a pool for a spec and page size; every pool page count includes page 0."""
    page_size: int
    full_page_bytes: int          # C4 + indexer + C128 bytes per full page, all layers
    swa_page_bytes: int           # SWA bytes per SWA page, all layers
    state_bytes_per_request: int  # compressor state rings of one request slot, all layers

    def total_bytes(self, max_total_tokens: int, swa_tokens: int, max_num_reqs: int) -> int:
        """Exactly what create_dsv4_kv_cache allocates for these sizes."""
        p = self.page_size
        return ((max_total_tokens // p + 1) * self.full_page_bytes
                + (swa_tokens // p + 1) * self.swa_page_bytes
                + (max_num_reqs + 1) * self.state_bytes_per_request)

    def max_total_tokens_for(self, budget_bytes: int, swa_tokens: int, max_num_reqs: int) -> int:
        """The largest page-aligned full pool that fits budget_bytes next to an SWA pool of
        swa_tokens and max_num_reqs request slots."""
        fixed = self.total_bytes(0, swa_tokens, max_num_reqs)
        if fixed > budget_bytes:
            raise ValueError(f"budget_bytes={budget_bytes} is below the {fixed} bytes the SWA "
                             f"pool (swa_tokens={swa_tokens}), page 0 and the state of "
                             f"max_num_reqs={max_num_reqs} requests need")
        if self.full_page_bytes == 0:
            raise ValueError("the spec holds no compressed layer: the full pool takes no bytes, "
                             "so a byte budget does not bound it")
        return (budget_bytes - fixed) // self.full_page_bytes * self.page_size


def footprint(spec: KVCacheSpec, page_size: int) -> CacheFootprint:
    spec.check_page_size(page_size)
    c4, c128 = len(spec.layers_with_ratio(4)), len(spec.layers_with_ratio(128))
    full = 0
    if c4:
        full += c4 * (kv_layout.page_bytes(page_size // 4)
                      + kv_layout.indexer_page_bytes(page_size // 4))
    if c128:
        full += c128 * kv_layout.page_bytes(page_size // 128)
    state = FP32_BYTES * (
        c4 * STATE_RING[4] * (ATTN_STATE_WIDTH[4] + INDEXER_STATE_WIDTH)
        + c128 * STATE_RING[128] * ATTN_STATE_WIDTH[128])
    return CacheFootprint(page_size, full, len(spec.layer_ids) * kv_layout.page_bytes(page_size),
                          state)
