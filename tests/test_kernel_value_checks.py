"""DSV4_KERNEL_VALUE_CHECKS: range checks (host syncs) can be switched off for eager GPU decode;
shape and dtype checks always run."""

import pytest
import torch

import hip_kernels as hk

P = 2


def _args():
    kv = torch.randn(2, 512).bfloat16()
    cache = torch.zeros(2, hk.page_bytes(P), dtype=torch.uint8)
    return kv, cache


def test_out_of_range_location_raises_with_checks_on(flag_env):
    flag_env(DSV4_KERNEL_BACKEND="torch")
    kv, cache = _args()
    with pytest.raises(IndexError, match="out_loc holds location 4"):
        hk.fused_store_cache(kv, cache, torch.tensor([0, 4]), P)
    assert not cache.any()


def test_checks_off_skips_the_range_read_but_not_shape_checks(flag_env, monkeypatch):
    flag_env(DSV4_KERNEL_BACKEND="torch", DSV4_KERNEL_VALUE_CHECKS="0")
    kv, cache = _args()
    reads = []
    real_max = torch.Tensor.max
    monkeypatch.setattr(torch.Tensor, "max", lambda self, *a, **k: reads.append(1) or real_max(self, *a, **k))
    hk.fused_store_cache(kv, cache, torch.tensor([0, 3]), P)
    assert reads == []
    with pytest.raises(ValueError, match="out_loc must have shape"):
        hk.fused_store_cache(kv, cache, torch.tensor([0, 1, 2]), P)
