"""Tests for the mutants a sampled mutation run (scripts/mutation_score.py --sample 35 --seed 0)
left alive: exact argument names in error messages, defaults that the other tests always
override, and boundary values of the argument checks."""

import pytest
import torch

import hip_kernels as hk
from hip_kernels import platform
from hip_kernels.backend import BackendUnavailable, resolve
from mem_pool import KVCacheSpec, PagedAllocator, create_dsv4_kv_cache
from mem_pool.loc_checks import check_loc_tensor
from mem_pool_testlib import small_pool

P = 4


def test_describe_names_the_backend():
    d = platform.describe()
    assert d["backend"] == platform.backend() and d["fp8_dialect"] == platform.fp8_dialect().name


def test_a_repeated_slot_message_says_what_may_repeat():
    rows = torch.zeros(2, 512, dtype=torch.bfloat16)
    cache = torch.zeros(2, hk.page_bytes(P), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"holds slot 3 2 times: each slot >= 1 may be written by "
                                         r"one row only \(0, the dummy, may repeat\)"):
        hk.fused_store_cache(rows, cache, torch.tensor([3, 3]), P,
                             options=hk.KernelOptions(backend="torch"))


def test_asking_for_triton_on_a_cpu_says_how(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match=r"\(got device cpu\); on a CPU set "
                                                 r"TRITON_INTERPRET=1 before triton is first "
                                                 r"imported$"):
        resolve("fused_store_cache", torch.device("cpu"), "triton")


def test_allocator_messages_name_free_index():
    a = PagedAllocator(8 * P, P)
    with pytest.raises(TypeError, match="^free_index must have dtype"):
        a.free(torch.tensor([4.0]))
    locs = a.alloc(P)
    a.free(locs)
    with pytest.raises(ValueError, match="^free_index refers to page 1, which is not allocated"):
        a.free(locs)


def test_check_loc_tensor_names_the_type_it_got():
    with pytest.raises(TypeError, match="loc must be a torch.Tensor, got list"):
        check_loc_tensor("loc", [1, 2], torch.device("cpu"))


def test_the_pool_defaults_to_the_cpu():
    pool, allocator = create_dsv4_kv_cache(KVCacheSpec((0,)), 4 * P, 4 * P, P)
    assert pool.device == torch.device("cpu")
    assert allocator.alloc(P).device == torch.device("cpu")


def test_the_smallest_valid_sizes_are_accepted():
    _, al = small_pool(full_tokens=4 * P, swa_tokens=4 * P, page_size=P)
    assert al.alloc_extend_swa_tail(1, 1).tolist() == [P]        # one token, its SWA slot
    assert KVCacheSpec((0,), window_size=1).window_size == 1


def test_loading_a_copy_with_state_says_it_needs_a_request_slot():
    pool, al = small_pool((4,), full_tokens=8 * P, swa_tokens=8 * P, page_size=P)
    locs = al.alloc(P)
    copy = pool.get_cpu_copy(locs)                                # no request slot: no state
    with pytest.raises(ValueError, match=r"compressor state \(it does not\)"):
        pool.load_cpu_copy(copy, locs, req_pool_idx=1)
