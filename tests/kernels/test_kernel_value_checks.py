"""KernelOptions.value_checks (DSV4_KERNEL_VALUE_CHECKS): range checks (host syncs) can be
switched off for eager GPU decode; shape and dtype checks always run."""

import pytest
import torch

import hip_kernels as hk
from hip_kernels import KernelOptions
from hip_kernels.checks import check_slot_values

P = 2
TORCH = KernelOptions(backend="torch")


def _args():
    kv = torch.randn(2, 512).bfloat16()
    cache = torch.zeros(2, hk.page_bytes(P), dtype=torch.uint8)
    return kv, cache


def test_out_of_range_location_raises_with_checks_on(flag_env):
    kv, cache = _args()
    with pytest.raises(IndexError, match="out_loc holds location 4"):
        hk.fused_store_cache(kv, cache, torch.tensor([0, 4]), P, kernel=TORCH)
    assert not cache.any()


def test_checks_off_skips_the_range_read_but_not_shape_checks(flag_env, monkeypatch):
    unchecked = KernelOptions(backend="torch", value_checks=False)
    kv, cache = _args()
    reads = []
    real_max = torch.Tensor.max
    monkeypatch.setattr(torch.Tensor, "max", lambda self, *a, **k: reads.append(1) or real_max(self, *a, **k))
    hk.fused_store_cache(kv, cache, torch.tensor([0, 3]), P, kernel=unchecked)
    assert reads == []
    with pytest.raises(ValueError, match="out_loc must have shape"):
        hk.fused_store_cache(kv, cache, torch.tensor([0, 1, 2]), P, kernel=unchecked)


def test_a_slot_written_twice_is_refused_before_any_write(flag_env):
    """Duplicate slots >= 1 in one call would leave backend-dependent bytes; the dummy slot 0
    (shared by padded rows) may repeat."""
    kv = torch.randn(4, 512).bfloat16()
    cache = torch.zeros(2, hk.page_bytes(P), dtype=torch.uint8)
    with pytest.raises(ValueError, match="out_loc holds slot 3 2 times"):
        hk.fused_store_cache(kv, cache, torch.tensor([3, 1, 3, -1]), P, kernel=TORCH)
    assert not cache.any()
    hk.fused_store_cache(kv, cache, torch.tensor([0, 2, 0, -1]), P, kernel=TORCH)  # 0: repeats
    assert cache.any()
    full_to_swa = torch.tensor([0, 2, 2, 3, -1])      # two full locations share SWA slot 2
    cache.zero_()
    with pytest.raises(ValueError, match=r"full_loc \(through full_to_swa\) holds slot 2 2 times"):
        hk.fused_translate_norm_rope_store(kv, torch.ones(512), 1e-6,
                                           torch.ones(8, 32, dtype=torch.complex64),
                                           torch.zeros(4, dtype=torch.int64),
                                           torch.tensor([1, 2, 3, -1]), full_to_swa, cache, P,
                                           kernel=TORCH)
    assert not cache.any()


@pytest.mark.parametrize("eps", [float("nan"), -1e-6, float("inf"), "1e-6"])
def test_a_bad_eps_is_refused_before_any_write(eps):
    kv, cache = _args()
    freqs = torch.polar(torch.ones(4, 32), torch.zeros(4, 32))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        hk.fused_k_norm_rope_store(kv, torch.ones(512).bfloat16(), eps, freqs,
                                   torch.zeros(2, dtype=torch.int64), torch.tensor([0, 1]), cache,
                                   P)
    assert not cache.any()


@pytest.mark.parametrize("page_size", [2.0, 0, True])
def test_a_page_size_that_is_not_a_positive_int_is_refused(page_size):
    kv, cache = _args()
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        hk.fused_store_cache(kv, cache, torch.tensor([0, 1]), page_size)
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        hk.indexer_store(torch.zeros(2, 128), torch.zeros(2, 264, dtype=torch.uint8),
                         torch.tensor([0, 1]), page_size)
    assert not cache.any()


def test_trusted_locations_skip_the_host_reads_but_the_kernel_still_masks(flag_env):
    """Inside trusted_locations() the caller vouches for the ranges: no host read; a wrong
    location still cannot write outside the cache (the store masks it)."""
    from hip_kernels.checks import trusted_locations, value_checks_enabled

    kv, cache = _args()
    assert value_checks_enabled(TORCH)
    assert not value_checks_enabled(KernelOptions(value_checks=False))
    with trusted_locations():
        with trusted_locations():
            assert not value_checks_enabled(TORCH)
        assert not value_checks_enabled(TORCH)
        hk.fused_store_cache(kv, cache, torch.tensor([1, 4]), P, kernel=TORCH)  # 4: past it
    assert value_checks_enabled(TORCH)
    assert cache[0, :hk.page_bytes(P) // 2].any()                  # slot 1 was written
    with pytest.raises(IndexError, match="out_loc holds location 4"):
        hk.fused_store_cache(kv, cache, torch.tensor([1, 4]), P, kernel=TORCH)


@pytest.mark.parametrize("bad, match", [
    (dict(backend="cuda"), r"backend='cuda': expected one of auto\|hip\|triton\|torch"),
    (dict(aiter="on"), r"aiter='on': expected one of auto\|0\|1"),
])
def test_bad_options_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        KernelOptions(**bad)
    kv, cache = _args()
    with pytest.raises(TypeError, match="kernel must be a hip_kernels.KernelOptions, got dict"):
        hk.fused_store_cache(kv, cache, torch.tensor([0, 1]), P, kernel=bad)
    with pytest.raises(ValueError, match="backend='cuda': expected one of"):
        hk.backend.resolve("fused_store_cache", kv.device, "cuda")
    assert not cache.any()


def test_a_repeated_slot_message_says_what_may_repeat():
    rows = torch.zeros(2, 512, dtype=torch.bfloat16)
    cache = torch.zeros(2, hk.page_bytes(P), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"holds slot 3 2 times: each slot >= 1 may be written by "
                                         r"one row only \(0, the dummy, may repeat\)"):
        hk.fused_store_cache(rows, cache, torch.tensor([3, 3]), P,
                             kernel=hk.KernelOptions(backend="torch"))


def test_slot_checks_on_their_own():
    """One slot, skipped rows (-1) and repeated dummies (0) pass; the largest slot written twice
    and a slot past the cache are named."""
    check_slot_values("loc", torch.tensor([5]), 8)
    check_slot_values("loc", torch.tensor([-1, 0, 7, 0, -1, 3]), 8)
    with pytest.raises(IndexError, match=r"loc holds location 8 but the cache has 8 slots "
                                         r"\(valid: -1 to skip, or 0\.\.7\)"):
        check_slot_values("loc", torch.tensor([8]), 8)
    with pytest.raises(IndexError, match="^row 9 is past the end$"):
        check_slot_values("loc", torch.tensor([1, 9]), 8, range_message="row {hi} is past the end")
    with pytest.raises(ValueError, match="loc holds slot 5 3 times"):
        check_slot_values("loc", torch.tensor([2, 5, 2, 5, 5, -1]), 8)
