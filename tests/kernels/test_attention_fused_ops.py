"""The attention's fused dispatcher ops against the unfused chains they replace (bit for bit:
the torch reference of each op is that chain), one op per call, argument checks:
indexer_query (RoPE + Hadamard + FP4 of the index queries), indexer_topk (masked top-k),
grouped_out_proj (inverse RoPE + grouped wo_a)."""

import pytest
import torch

from hip_kernels import KernelOptions
from hip_kernels.activation_sim import fp4_quant_dequant, hadamard_rotate
from hip_kernels.grouped_out_proj import grouped_out_proj
from hip_kernels.indexer_query import indexer_query
from hip_kernels.indexer_topk import indexer_topk, picked_rows
from hip_kernels.rotary import rope_tail
from op_recorder import op_names

TORCH = KernelOptions(backend="torch")
UNCHECKED = KernelOptions(value_checks=False)   # no positions range check: one op, as the engine
POS = torch.tensor([4, 0, 6, 2, 5, 1, 3])   # tokens' positions (rows of a RoPE table), in no order


def freqs(n, rope, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.polar(torch.ones(n, rope // 2), torch.rand(n, rope // 2, generator=g) * 6.3)


def randn(*shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("reference", [True, False])
def test_indexer_query_is_the_unfused_chain(reference):
    n, h, d, rope = 5, 4, 128, 64
    q, f, pos = randn(n, h * d, seed=1, scale=2), freqs(n + 4, rope, 2), POS[:n]
    want = fp4_quant_dequant(hadamard_rotate(rope_tail(q.view(n, h, d), f[pos], rope),
                                             reference))
    got = indexer_query(q, f, pos, h, rope, reference=reference, kernel=TORCH)
    assert got.shape == (n, h, d) and torch.equal(got, want)
    assert op_names(lambda: indexer_query(q, f, pos, h, rope, reference=reference,
                                          kernel=UNCHECKED)) == [
        "dsv4::indexer_query"]


def test_indexer_topk_keeps_the_visible_best():
    scores = torch.tensor([[0.5, 3.0, 2.0, 9.0], [1.0, 4.0, -2.0, 0.0]])
    visible = torch.tensor([[True, True, True, False], [False, True, False, False]])
    pick = indexer_topk(scores, visible, 3, use_aiter=False)
    assert pick.tolist() == [[1, 2, 0], [1, -1, -1]]
    assert op_names(lambda: indexer_topk(scores, visible, 3, use_aiter=False)) == [
        "dsv4::indexer_topk"]
    loc = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    rows, valid = picked_rows(loc, pick)
    assert rows.tolist() == [[11, 12, 10], [21, 20, 20]]
    assert valid.tolist() == [[True] * 3, [True, False, False]]
    assert op_names(lambda: picked_rows(loc, pick)) == ["dsv4::picked_rows"]


def test_grouped_out_proj_is_the_unfused_chain():
    n, h, d, g, r, rope = 3, 8, 64, 2, 16, 32
    o, f, pos = randn(n, h, d, seed=3), freqs(n + 4, rope, 4), POS[:n]
    w = randn(g * r, h * d // g, seed=5, scale=0.1)
    x = rope_tail(o, f[pos], rope, inverse=True).flatten(1).unflatten(-1, (g, -1))
    want = torch.einsum("ngd,grd->ngr", x, w.view(g, r, -1)).flatten(1)
    got = grouped_out_proj(o, f, pos, w, g, rope, kernel=TORCH)
    assert got.dtype == o.dtype and torch.equal(got, want)
    assert op_names(lambda: grouped_out_proj(o, f, pos, w, g, rope, kernel=UNCHECKED)) == [
        "dsv4::grouped_out_proj"]


@pytest.mark.parametrize("call, match", [
    (lambda: indexer_query(torch.zeros(2, 96, dtype=torch.bfloat16), freqs(2, 64, 0), POS[:2],
                           1, 64, reference=True), "power of two"),
    # the heads already split ([N, n_heads, D]): the projection's flat rows are expected
    (lambda: indexer_query(torch.zeros(2, 2, 128, dtype=torch.bfloat16), freqs(2, 64, 0),
                           POS[:2], 2, 64, reference=True), "q must be 2-D"),
    (lambda: indexer_query(torch.zeros(2, 256, dtype=torch.bfloat16), freqs(3, 62, 0), POS[:2],
                           2, 64, reference=True), r"freqs_cis must have shape \[\*, 32\]"),
    (lambda: indexer_query(torch.zeros(2, 256, dtype=torch.bfloat16), freqs(3, 64, 0), POS[:3],
                           2, 64, reference=True), r"positions must have shape \[2\]"),
    (lambda: indexer_query(torch.zeros(2, 256, dtype=torch.bfloat16), freqs(3, 64, 0),
                           torch.tensor([0, 3]), 2, 64, reference=True),
     r"positions holds 3 but freqs_cis has 3 rows"),
    (lambda: grouped_out_proj(torch.zeros(2, 6, 64, dtype=torch.bfloat16), freqs(2, 32, 0),
                              torch.tensor([0, -1]), torch.zeros(8, 192, dtype=torch.bfloat16),
                              2, 32), r"positions holds -1 but freqs_cis has 2 rows"),
    (lambda: grouped_out_proj(torch.zeros(2, 6, 64, dtype=torch.bfloat16), freqs(2, 32, 0),
                              POS[:2].float(), torch.zeros(8, 192, dtype=torch.bfloat16), 2, 32),
     "positions must have dtype"),
    (lambda: indexer_topk(torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool), 5,
                          use_aiter=False), "k=5"),
    (lambda: grouped_out_proj(torch.zeros(2, 6, 64, dtype=torch.bfloat16), freqs(2, 32, 0),
                              POS[:2], torch.zeros(8, 96, dtype=torch.bfloat16), 4, 32),
     "n_groups=4"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises((TypeError, ValueError, IndexError), match=match):
        call()


def test_compressor_ops_are_the_unfused_chain():
    """A ratio-4 (overlap) indexer compressor: two candidate windows, one without a previous
    window; the ring keeps the new rows (the raw gate output as score) after the pool has read
    the old ones (ring row 0 is both read and overwritten); the pool adds the window row j's
    position bias ape[j % ratio] to its score."""
    from types import SimpleNamespace

    from hip_kernels.compressor_update import (compressor_project, compressor_update,
                                               finish_rows, pool_windows)
    n, dim, d, ratio, rope = 4, 32, 32, 4, 16
    width = 2 * d
    x = randn(n, dim, seed=6)
    wkv, wgate = randn(width, dim, seed=7, dtype=torch.float32), randn(width, dim, seed=8,
                                                                       dtype=torch.float32)
    ape = randn(ratio, width, seed=9, dtype=torch.float32)
    new = compressor_project(x, wkv, wgate)
    xf = x.float()
    assert torch.equal(new, torch.cat([xf @ wkv.T, xf @ wgate.T], 1))

    state = randn(17, 2 * width, seed=10, dtype=torch.float32)
    plan = SimpleNamespace(src_state=torch.tensor([[0, 1, 2, 3, 4, 5, 6, -1], [-1] * 8]),
                           src_new=torch.tensor([[-1] * 7 + [1], [0] * 8]),
                           has_prev=torch.tensor([True, False]), window_start=torch.tensor([4, 0]),
                           state_write=torch.tensor([0, -1, 9, 10]))
    table = freqs(16, rope, 11)
    w = torch.rand(d) + 0.5
    before = state.clone()
    rows = torch.where((plan.src_new >= 0).unsqueeze(-1), new[plan.src_new.clamp(min=0)],
                       before[plan.src_state.clamp(min=0)])
    score = rows[..., width:] + ape[torch.arange(2 * ratio) % ratio]
    pooled = pool_windows(rows[..., :width], score, plan.has_prev, d, ratio, True)
    want = finish_rows(pooled, w, 1e-6, table[plan.window_start], rope, True, torch.bfloat16,
                       True)
    got = compressor_update(new, state, plan, ape, table, w, 1e-6, ratio=ratio, head_dim=d,
                            rope_dim=rope, overlap=True, rotate=True, reference=True,
                            dtype=torch.bfloat16)
    assert torch.equal(got, want)
    assert torch.equal(state[[0, 9, 10]], new[[0, 2, 3]]) and torch.equal(state[1:9], before[1:9])
    assert op_names(lambda: compressor_update(new, state, plan, ape, table, w, 1e-6, ratio=ratio,
                                              head_dim=d, rope_dim=rope, overlap=True,
                                              rotate=True, reference=True,
                                              dtype=torch.bfloat16)) == ["dsv4::compressor_update"]
