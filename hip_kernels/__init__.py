"""Kernels of the DeepSeek-V4 decode backend: torch references, Triton kernels and HIP C++ for the
set-KV family (`set_kv`), mHC's split with its Sinkhorn normalisation (`mhc_split`), mHC pre
(+ the block's norm), post and the head (+ the final norm) (`mhc_fused`), the MoE's routing,
routed and shared experts (`moe_fused`), the sparse decode attention (`decode_attention`), the
indexer's scores (`indexer_scores`), a step's attention plan over the paged tables
(`attention_plan`) and the quantized linears of the FP8/FP4 checkpoints (`quant_linear`), each a
dispatcher op of the `dsv4` library (`library`). Every op takes its choices as values:
`kernel` (a `KernelOptions`: backend, host checks, aiter) and its numerics.

This package imports only torch (triton and compiled extensions are imported lazily inside the
functions that need them), so ``import hip_kernels`` works on a machine without triton.
"""

import logging

from . import envs, platform
from .attention_plan import attention_plan
from .decode_attention import sparse_decode_attention
from .grouped_out_proj import grouped_out_proj
from .indexer_query import indexer_query
from .indexer_scores import indexer_scores, indexer_scores_shared
from .indexer_topk import indexer_topk, picked_rows
from .kv_layout import (dequantize_kv_rows, indexer_page_bytes, page_bytes, quantize_kv_rows,
                        read_indexer_rows, read_kv_rows)
from .mhc_fused import hc_head, hc_post, hc_pre
from .mhc_split import hc_split
from .plain_linear import plain_linear
from .moe_fused import moe_route, moe_routed, moe_shared
from .numerics import DEFAULT_NUMERICS, REFERENCE_NUMERICS, StoreNumerics
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from .quant_linear import fp4_grouped_linear, fp8_grouped_linear, fp8_linear
from .quant_linear_ref import act_quant, ocp_to_fnuz
from .rms_norm import rms_norm
from .set_kv import (fused_k_norm_rope_store, fused_store_cache, fused_translate_norm_rope_store,
                     indexer_store, store_kv_pack)

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "envs", "platform", "KernelOptions", "DEFAULT_KERNEL_OPTIONS",
    "StoreNumerics", "DEFAULT_NUMERICS", "REFERENCE_NUMERICS",
    "page_bytes", "indexer_page_bytes", "quantize_kv_rows", "dequantize_kv_rows", "read_kv_rows",
    "read_indexer_rows",
    "fused_k_norm_rope_store", "fused_store_cache", "store_kv_pack", "indexer_store",
    "fused_translate_norm_rope_store", "hc_split", "hc_pre", "hc_post", "hc_head", "moe_route",
    "moe_routed", "moe_shared", "sparse_decode_attention", "indexer_scores",
    "indexer_scores_shared",
    "rms_norm", "indexer_query", "indexer_topk", "picked_rows", "grouped_out_proj",
    "attention_plan", "act_quant", "ocp_to_fnuz", "fp8_linear", "fp8_grouped_linear",
    "fp4_grouped_linear", "plain_linear",
]
