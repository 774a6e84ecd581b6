"""Kernels of the DeepSeek-V4 decode backend: torch references, Triton kernels and HIP C++ for the
set-KV family (`set_kv`), and mHC's split with its Sinkhorn normalisation (`mhc_split`).

This package imports only torch (triton and compiled extensions are imported lazily inside the
functions that need them), so ``import hip_kernels`` works on a machine without triton.
"""

import logging

from . import envs, platform
from .kv_layout import (DEFAULT_NUMERICS, StoreNumerics, dequantize_kv_rows, indexer_page_bytes,
                        page_bytes, quantize_kv_rows, read_indexer_rows, read_kv_rows)
from .platform import fp8_dialect
from .set_kv import (fused_k_norm_rope_store, fused_store_cache, fused_translate_norm_rope_store,
                     indexer_store, store_kv_pack)

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "envs", "platform", "fp8_dialect", "StoreNumerics", "DEFAULT_NUMERICS",
    "page_bytes", "indexer_page_bytes", "quantize_kv_rows", "dequantize_kv_rows", "read_kv_rows",
    "read_indexer_rows",
    "fused_k_norm_rope_store", "fused_store_cache", "store_kv_pack", "indexer_store",
    "fused_translate_norm_rope_store",
]
