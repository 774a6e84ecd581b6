"""The compressor state ring's content: each token's [x @ wkv^T | x @ wgate^T], the raw gate
output with no position bias (SGLang's ring holds the same), the bias ape added only when a
window is pooled. On position-consistent steps (a ring holding earlier positions of each
request, this step's tokens after them), the pooled rows are the bits of the formula that
stored gate + ape[pos % ratio] in the ring (the torch path), and the Triton kernels agree with
those bits to their stated tolerance."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from hip_kernels.compressor_update import (compressor_project, compressor_update,  # noqa: E402
                                           finish_rows, pool_windows)
from hip_kernels.options import KernelOptions  # noqa: E402
from hip_kernels.platform import default_device  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

DEV = default_device()
BACKENDS = {"torch": KernelOptions(backend="torch"), "triton": KernelOptions(backend="triton")}
EPS, DIM, ROPE, RING = 1e-6, 64, 16, 64      # RING rows a request: position p at row p % RING


def step(ratio, overlap, requests):
    """A step's plan for requests [(ring base row, earlier positions, new positions)]: the
    rows of each window closing at a new position (position order, the previous window first
    with overlap), each from this step's rows or the ring; this step's rows kept at their
    positions' ring rows. Also the position of every new row and ring row read."""
    coff = 2 if overlap else 1
    src_state, src_new, has_prev, start, write, new_pos = [], [], [], [], [], []
    for base, earlier, fresh in requests:
        index = {p: len(new_pos) + i for i, p in enumerate(fresh)}
        for p in fresh:
            if (p + 1) % ratio:
                continue
            first = p + 1 - ratio
            rows = range(first - (coff - 1) * ratio, p + 1)
            src_new.append([index.get(q, -1) for q in rows])
            src_state.append([base + q % RING if q in earlier else -1 for q in rows])
            has_prev.append(first - ratio >= 0 or not overlap)
            start.append(first)
        write += [base + p % RING for p in fresh]
        new_pos += fresh
    t = lambda v, dtype=torch.int64: torch.tensor(v, dtype=dtype, device=DEV)  # noqa: E731
    rows = coff * ratio
    return SimpleNamespace(src_state=t(src_state).view(-1, rows), src_new=t(src_new).view(-1, rows),
                           has_prev=t(has_prev, torch.bool), window_start=t(start),
                           state_write=t(write)), t(new_pos)


CASES = {   # ratio, overlap, rotate, requests (two windows with a previous one, one without)
    "c4 indexer": (4, True, True, [(0, list(range(6)), list(range(6, 14))),
                                   (RING, [], [0, 1, 2, 3, 4])]),
    "c4": (4, True, False, [(0, list(range(6)), list(range(6, 14))),
                            (RING, [], [0, 1, 2, 3, 4])]),
    "plain (ratio 16)": (16, False, False, [(0, list(range(13)), list(range(13, 35))),
                                            (RING, [], list(range(16)))]),
}


def inputs(ratio, overlap, requests, seed):
    """x [N, DIM] bf16, the fp32 weights, a nonzero ape, a ring whose earlier positions hold
    their tokens' raw rows (the rest random), the RoPE table and the norm weight."""
    d = 64
    width = (2 if overlap else 1) * d
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    plan, pos = step(ratio, overlap, requests)
    x = r(pos.numel(), DIM).bfloat16().to(DEV)
    wkv, wgate = (r(width, DIM) / DIM ** 0.5).to(DEV), (r(width, DIM) / DIM ** 0.5).to(DEV)
    ape = r(ratio, width).to(DEV)
    state = r(2 * RING + 1, 2 * width).to(DEV)
    for base, earlier, _ in requests:
        for p in earlier:      # an earlier token's raw row, as an earlier step kept it
            state[base + p % RING] = torch.cat([r(width), r(width)]).to(DEV)
    table = torch.polar(torch.ones(64, ROPE // 2), r(64, ROPE // 2)).to(DEV)
    w = (torch.rand(d, generator=g) + 0.5).to(DEV)
    return plan, pos, x, wkv, wgate, ape, state, table, w, d


def biased_pool(plan, pos, new, state, ape, requests, ratio, overlap, rotate, table, w, d, dtype):
    """The formula whose ring held gate + ape[pos % ratio]: the bias added to every row where it
    was stored (this step's rows at their positions, each ring row at its position), then the
    pool and finish on the stored scores as they are."""
    width = new.shape[1] // 2
    new_b, state_b = new.clone(), state.clone()
    new_b[:, width:] = new[:, width:] + ape[pos % ratio]
    for base, earlier, _ in requests:
        for p in earlier:
            state_b[base + p % RING, width:] = state[base + p % RING, width:] + ape[p % ratio]
    rows = torch.where((plan.src_new >= 0).unsqueeze(-1), new_b[plan.src_new.clamp(min=0)],
                       state_b[plan.src_state.clamp(min=0)])
    pooled = pool_windows(rows[..., :width], rows[..., width:], plan.has_prev, d, ratio, overlap)
    return finish_rows(pooled, w, EPS, table[plan.window_start.clamp(min=0)], ROPE, rotate, dtype,
                       True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ring_keeps_the_raw_gate_output(backend):
    """After a step the ring's rows at this step's positions are [x @ wkv^T | x @ wgate^T]: no
    ape in the score half, though ape is far from zero (the torch path: F.linear's bits; the
    Triton projection: to its fp32 tolerance, and its ring write byte for byte)."""
    kernel = BACKENDS[backend]
    ratio, overlap, rotate, requests = CASES["c4"]
    plan, pos, x, wkv, wgate, ape, state, table, w, d = inputs(ratio, overlap, requests, seed=1)
    width = wkv.shape[0]
    new = compressor_project(x, wkv, wgate, kernel=kernel)
    compressor_update(new, state, plan, ape, table, w, EPS, ratio=ratio, head_dim=d,
                      rope_dim=ROPE, overlap=overlap, rotate=rotate, reference=True,
                      dtype=torch.bfloat16, kernel=kernel)
    kept = state[plan.state_write]
    assert torch.equal(kept.view(torch.int32), new.view(torch.int32))
    gate = F.linear(x.float(), wgate)
    if backend == "torch":
        assert torch.equal(kept[:, :width], F.linear(x.float(), wkv))
        assert torch.equal(kept[:, width:], gate)
    else:
        torch.testing.assert_close(kept[:, width:], gate, rtol=1e-5, atol=1e-5)
    assert ((kept[:, width:] - gate - ape[pos % ratio]).abs().amax(-1) > 0.1).all()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_pool_gives_the_bits_of_a_ring_holding_the_bias(case, dtype):
    """Torch path: gate + ape made at the pool is the same fp32 sum as made at the projection,
    so every compressed row is the old formula's bits (a masked previous window stays -inf)."""
    ratio, overlap, rotate, requests = CASES[case]
    plan, pos, x, wkv, wgate, ape, state, table, w, d = inputs(ratio, overlap, requests, seed=2)
    new = compressor_project(x, wkv, wgate, kernel=BACKENDS["torch"])
    want = biased_pool(plan, pos, new, state, ape, requests, ratio, overlap, rotate, table, w, d,
                       dtype)
    got = compressor_update(new, state.clone(), plan, ape, table, w, EPS, ratio=ratio,
                            head_dim=d, rope_dim=ROPE, overlap=overlap, rotate=rotate,
                            reference=True, dtype=dtype, kernel=BACKENDS["torch"])
    assert plan.window_start.numel() == 3 and bool(plan.has_prev.all()) != overlap
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("case", CASES)
def test_the_triton_pool_agrees_with_a_ring_holding_the_bias(case):
    """The Triton kernels (ape added in the pool kernel) against the old formula's torch bits,
    to the tolerance of tests/kernels/test_compressor_triton.py: fp32 rows (unrotated) within
    2e-6 of the row's amax; bf16 rows at least 99% bit-equal, the rest within a bf16 (or,
    rotated, an FP4) rounding."""
    ratio, overlap, rotate, requests = CASES[case]
    plan, pos, x, wkv, wgate, ape, state, table, w, d = inputs(ratio, overlap, requests, seed=3)
    new = compressor_project(x, wkv, wgate, kernel=BACKENDS["triton"])
    for dtype in (torch.bfloat16,) if rotate else (torch.float32, torch.bfloat16):
        want = biased_pool(plan, pos, new, state, ape, requests, ratio, overlap, rotate, table,
                           w, d, dtype)
        got = compressor_update(new, state.clone(), plan, ape, table, w, EPS, ratio=ratio,
                                head_dim=d, rope_dim=ROPE, overlap=overlap, rotate=rotate,
                                reference=True, dtype=dtype, kernel=BACKENDS["triton"])
        g, r = got.float(), want.float()
        if dtype == torch.float32:
            assert ((g - r).abs() <= 2e-6 * r.abs().amax(-1, keepdim=True)).all()
            continue
        assert (got == want).float().mean() >= 0.99
        if rotate:
            amax = r.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
            bound = (2 * amax / 3).expand(-1, -1, 32).flatten(-2) + 1e-6
            assert ((g - r).abs() <= bound).all()
        else:
            torch.testing.assert_close(g, r, rtol=2 ** -7, atol=1e-5)
