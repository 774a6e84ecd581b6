"""SGLang 0.5.23's DeepSeekV4TokenToKVPool seen through the pool interface this project's model
reads and writes (`DeepseekV4Model.forward(batch, pool, req_to_token, ...)`), so the model runs
over SGLang's own buffers: every getter returns SGLang's tensor itself or a view of it, never a
copy.

What each getter serves, by SGLang's layer numbering (a stage's SWA buffers by layer_id - its
start; C4/C128 KV and indexer buffers by the layer's rank among the layers of its ratio, which
SGLang's own getters map; state pools by the global layer id):

- ``get_swa_cache``: `get_swa_raw_buffer`, uint8 [SWA pages, page bytes], our V4 page layout;
- ``get_compressed_cache`` / ``compressed_page_size``: `get_extra_key_buffer` (SGLang hands it
  out as fp8: viewed as its uint8 bytes) and `get_extra_key_page_size`;
- ``get_indexer_cache``: `get_index_k_with_scale_buffer`, the page of FP8 payloads then fp32
  scales, as ours; the payload row-major, or in 16 x 16 tiles when SGLang preshuffles it for
  aiter's paged MQA (``indexer_key_tile`` 16: the model's indexer kernels read and write that
  order; the tile order was read from SGLang's source, its fused_norm_rope_v2.cuh store);
- ``get_compressor_state`` / ``get_indexer_compressor_state``: the flat fp32 [rows, width]
  `kv_score` of `get_attention_compress_states` / `get_indexer_compress_states`. SGLang keeps a
  C4 ring per SWA page (``state_ring_swa_page`` says so, the attention plan addresses rows
  accordingly) and a C128 ring per request slot (row slot * 128 + position % 128, as ours);
- ``full_to_swa_index_mapping`` / ``registered_mapping`` / ``get_cached_swa_loc``: the
  allocator's full -> SWA mapping SGLang's pool holds, and its int32 translation.

Rows SGLang never initialised (its C4 rings start as `torch.empty`) are never used: a window that
closes at this step pools its own row and the ring's earlier positions of its request, which that
request wrote (SGLang's prefill keeps them; a missing previous window is masked out, whatever its
rows hold); a token whose window does not close may pool unwritten rows in a captured step, but
its row is never stored. The last row of each state buffer is SGLang's empty sentinel; only an
extend, which writes the rows it does not keep there, touches it (a decode step keeps every row).

`mono_pool_problem(pool, compress_ratios)` names what a pool has that this view cannot serve;
`SGLangMonoPool(pool, compress_ratios)` refuses such a pool with that reason.
"""

from __future__ import annotations

import torch

from mem_pool.kv_cache_spec import ATTN_STATE_WIDTH, INDEXER_STATE_WIDTH, STATE_RING

from .sglang_pool_kind import not_plain_v4_pool

INDEXER_BYTES_PER_TOKEN = 128 + 4       # FP8 payload, fp32 scale


PRESHUFFLE_TILE = 16                    # the tile SGLang's preshuffled indexer payload uses


def _indexer_preshuffled() -> bool:
    """SGLang's own decision to lay the indexer's FP8 payload out in 16 x 16 tiles (aiter's
    preshuffled paged MQA, on ROCm)."""
    from sglang.srt.layers.attention.dsa.utils import aiter_can_use_preshuffle_paged_mqa

    return aiter_can_use_preshuffle_paged_mqa()


def mono_pool_problem(pool, compress_ratios) -> str | None:
    """Why this view cannot serve `pool` for a model of these per-layer compress ratios, or
    None."""
    reason = not_plain_v4_pool(pool)
    if reason:
        return reason
    ratios = list(compress_ratios)
    if list(pool.compression_ratios) != ratios:
        return (f"its compression_ratios {list(pool.compression_ratios)} are not the model's "
                f"{ratios}")
    if (pool._stage_start, pool._stage_end) != (0, len(ratios)):
        return (f"it holds layers {pool._stage_start}..{pool._stage_end - 1} of a pipeline stage, "
                f"not the model's {len(ratios)}")
    if pool.swa_page_size != pool.page_size:
        return (f"its SWA page size {pool.swa_page_size} differs from its page size "
                f"{pool.page_size} (the model pages both sides alike)")
    if getattr(pool, "swa_req_ring_size", None) is not None:
        return "its SWA KV lives in a per-request ring"
    for ratio in sorted(set(ratios) - {0}):
        problem = _ratio_problem(pool, ratio, ratios.index(ratio))
        if problem:
            return problem
    return None


def _ratio_problem(pool, ratio: int, layer_id: int) -> str | None:
    """What the buffers of a ratio (seen at its first layer) have that the model cannot use."""
    if ratio not in (4, 128):
        return f"it has compress ratio {ratio} (the model has only 4 and 128)"
    kv = pool.kv_pools.get(ratio)
    if type(kv).__name__ != "DeepSeekV4SingleKVPool":
        return f"its C{ratio} KV pool is a {type(kv).__name__} (HiSparse or another layout)"
    layout = getattr(pool.compressed_kv_layout(ratio), "value", None)
    if layout != "v4":
        return f"its C{ratio} KV layout is {layout!r}, not 'v4'"
    if pool.get_extra_key_page_size(layer_id) != pool.page_size // ratio:
        return (f"its C{ratio} page holds {pool.get_extra_key_page_size(layer_id)} rows, not "
                f"page_size // {ratio} = {pool.page_size // ratio}")
    states = [("attention", pool.get_attention_compress_states(layer_id),
               ATTN_STATE_WIDTH[ratio])]
    if ratio == 4:
        index = pool.index_pools.get(4)
        if index is None or index.use_fp4_indexer:
            return "its indexer keeps FP4 keys (the model's indexer cache is FP8)"
        if index.page_size != pool.page_size // 4:
            return (f"its indexer page holds {index.page_size} rows, not page_size // 4 = "
                    f"{pool.page_size // 4}")
        if index.get_bytes_per_token() != INDEXER_BYTES_PER_TOKEN:
            return (f"its indexer keeps {index.get_bytes_per_token()} bytes a row, not "
                    f"{INDEXER_BYTES_PER_TOKEN}")
        if _indexer_preshuffled() and index.page_size % PRESHUFFLE_TILE:
            return (f"its indexer payload is in {PRESHUFFLE_TILE} x {PRESHUFFLE_TILE} tiles but "
                    f"its page holds {index.page_size} rows, not a whole number of tiles")
        states.append(("indexer", pool.get_indexer_compress_states(layer_id),
                       INDEXER_STATE_WIDTH))
    for what, state, width in states:
        if state.online or state.ring_size != STATE_RING[ratio]:
            return (f"its C{ratio} {what} compressor state keeps a ring of {state.ring_size} "
                    f"rows{' (online compression)' if state.online else ''}, not "
                    f"{STATE_RING[ratio]}")
        buffer = state.kv_score_buffer.kv_score
        if buffer.dtype != torch.float32 or buffer.dim() != 2 or buffer.shape[1] != width:
            return (f"its C{ratio} {what} compressor state is {buffer.dtype} "
                    f"{tuple(buffer.shape)}, not fp32 [rows, {width}]")
        if state.request_scoped != (ratio == 128):
            return (f"its C{ratio} {what} compressor state is "
                    f"{'request' if state.request_scoped else 'SWA-page'}-scoped, not "
                    f"{'request' if ratio == 128 else 'SWA-page'}-scoped")
    return None


class SGLangMonoPool:
    """The pool interface of `DeepseekV4Model.forward` over a SGLang DeepSeekV4TokenToKVPool
    (see the module docstring). Make one per SGLang pool and keep it: the model's layers bind
    their buffer views to the pool object they are given."""

    def __init__(self, pool, compress_ratios):
        problem = mono_pool_problem(pool, compress_ratios)
        if problem:
            raise ValueError(f"pool: this SGLang DeepSeekV4TokenToKVPool cannot be served to "
                             f"the model: {problem}")
        self.pool = pool
        self.page_size = pool.page_size
        # SGLang's C4 rings (attention and indexer) are per SWA page; its C128 rings per slot.
        self.state_ring_swa_page = {4: pool.swa_page_size} if 4 in compress_ratios else {}
        # SGLang's decision, read once: the model reads and writes the indexer keys in its order.
        self.indexer_key_tile = PRESHUFFLE_TILE if _indexer_preshuffled() else 0

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor:
        return self.registered_mapping()

    def registered_mapping(self) -> torch.Tensor:
        """The full -> SWA mapping SGLang's allocator registered with the pool."""
        mapping = self.pool.full_to_swa_index_mapping
        if mapping is None:
            raise RuntimeError("no full->SWA mapping registered: SGLang's allocator registers "
                               "its mapping with the pool when it is made")
        return mapping

    def get_cached_swa_loc(self, loc: torch.Tensor) -> torch.Tensor:
        """int32 SWA slots of full locations (SGLang's translate_loc_from_full_to_swa)."""
        return self.registered_mapping()[loc].to(torch.int32)

    def get_swa_cache(self, layer_id: int) -> torch.Tensor:
        return self.pool.get_swa_raw_buffer(layer_id)

    def get_compressed_cache(self, layer_id: int) -> torch.Tensor:
        return self.pool.get_extra_key_buffer(layer_id).view(torch.uint8)

    def compressed_page_size(self, layer_id: int) -> int:
        return self.pool.get_extra_key_page_size(layer_id)

    def get_indexer_cache(self, layer_id: int) -> torch.Tensor:
        return self.pool.get_index_k_with_scale_buffer(layer_id)

    def get_compressor_state(self, layer_id: int) -> torch.Tensor:
        """fp32 [rows, 2 * width], [kv | score]; C4 rows by SWA page, C128 by request slot."""
        return self.pool.get_attention_compress_states(layer_id).kv_score_buffer.kv_score

    def get_indexer_compressor_state(self, layer_id: int) -> torch.Tensor:
        return self.pool.get_indexer_compress_states(layer_id).kv_score_buffer.kv_score
