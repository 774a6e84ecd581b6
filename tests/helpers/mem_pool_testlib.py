"""Small pools and model-shaped specs shared by the mem_pool tests."""

import torch

from mem_pool import KVCacheSpec, create_dsv4_kv_cache

# SPEC section 1: one ratio per layer, then the MTP layer's 0.
FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)     # 43 layers + MTP
PRO_RATIOS = (128, 128) + (4, 128) * 29 + (4, 0)   # 61 layers + MTP


def small_pool(ratios=(0, 0, 0), full_tokens=64, swa_tokens=32, page_size=4, max_num_reqs=4,
               cache_swa_translation=None, swa_cache_verify=None, **spec_kw):
    """(pool, allocator) of a small spec on the CPU."""
    spec = KVCacheSpec(ratios, **spec_kw)
    return create_dsv4_kv_cache(spec, full_tokens, swa_tokens, page_size, "cpu",
                                max_num_reqs=max_num_reqs,
                                cache_swa_translation=cache_swa_translation,
                                swa_cache_verify=swa_cache_verify)


def expected_swa(allocator, loc: torch.Tensor) -> torch.Tensor:
    """The translation computed from scratch (no cache): mapping[loc] as int32."""
    return allocator.full_to_swa_index_mapping[loc.long()].to(torch.int32)
