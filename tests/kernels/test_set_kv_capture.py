"""The torch set-KV writers can be captured in a graph (CPU emulation): no data-dependent shapes,
no host sync, and replay writes the live locations of each step, skipping negative ones."""

import torch

import hip_kernels as hk
from dsv4.graphs.emulation import EmulatedGraph, graph

P = 4
SENTINEL = 0xA5


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, 512, generator=g).bfloat16()
    k = torch.randn(n, 128, generator=g)
    return kv, k


def test_captured_stores_replay_live_locations_and_skip_negative():
    torch_backend = hk.KernelOptions(backend="torch")
    n = 3
    weight = torch.rand(512) + 0.5
    freqs = torch.polar(torch.ones(64, 32), torch.rand(64, 32) * 6)
    static_kv, static_k = _inputs(n, 0)
    static_pos = torch.zeros(n, dtype=torch.int64)
    static_loc = torch.zeros(n, dtype=torch.int64)
    cache = torch.full((4, hk.page_bytes(P)), SENTINEL, dtype=torch.uint8)
    icache = torch.full((4, hk.indexer_page_bytes(P)), SENTINEL, dtype=torch.uint8)

    def step():
        hk.fused_k_norm_rope_store(static_kv, weight, 1e-6, freqs, static_pos, static_loc, cache, P,
                                   kernel=torch_backend)
        hk.indexer_store(static_k, icache, static_loc, P, kernel=torch_backend)

    g = EmulatedGraph()
    with graph(g):
        step()

    for seed, locs in ((1, [5, -1, 9]), (2, [-1, 14, 2])):
        kv, k = _inputs(n, seed)
        loc = torch.tensor(locs)
        pos = torch.tensor([3, 7, 11])
        want, iwant = cache.clone(), icache.clone()
        hk.fused_k_norm_rope_store(kv, weight, 1e-6, freqs, pos, loc, want, P,
                                   kernel=torch_backend)
        hk.indexer_store(k, iwant, loc, P, kernel=torch_backend)
        static_kv.copy_(kv), static_k.copy_(k), static_pos.copy_(pos), static_loc.copy_(loc)
        g.replay()
        assert torch.equal(cache, want)
        assert torch.equal(icache, iwant)
    # location 12 was never a target: its value bytes still hold the sentinel
    assert bool((cache[3, :576] == SENTINEL).all())
    assert not bool((cache[3, 2 * 576:3 * 576] == SENTINEL).all())  # location 14 was written
