"""The Triton kernels of indexer_topk and picked_rows (under the interpreter) against their
references, index for index: the top-k is exactly topk_by_key's choice over the masked row
(ties to the lower column, NaN largest, -0 == +0), -1 where the value is -inf, at any width,
chunking and k; the gather is byte-exact."""

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import KernelOptions, aiter_ops, indexer_topk_triton  # noqa: E402
from hip_kernels.indexer_topk import indexer_topk, picked_rows, topk_by_key  # noqa: E402
from hip_kernels.indexer_topk_triton import blocks  # noqa: E402
from op_recorder import op_names  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

TRITON = KernelOptions(backend="triton")
NAN, INF = float("nan"), float("inf")


def key_choice(scores, visible, k, width=None):
    """topk_by_key over the masked row (columns past width -inf), -1 where the value is -inf."""
    masked = scores.masked_fill(~visible, -INF)
    if width is not None:
        masked = masked.masked_fill(torch.arange(scores.shape[1]) >= width.unsqueeze(1), -INF)
    vals, idx = topk_by_key(masked, k)
    return idx.masked_fill(vals == -INF, -1)


def tied_rows(n, t, seed, dtype=torch.bfloat16):
    """Few distinct values (most picks break ties), with NaN (either sign bit), -0.0/+0.0,
    -inf and +inf."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-4, 5, (n, t), generator=g).float() / 2
    special = torch.tensor([NAN, -0.0, 0.0, -INF, INF, NAN])
    special[5:] = special[5:].neg()                             # sign bit set (bf16's NaN too)
    at = torch.randint(0, t, (n, 8), generator=g)
    scores.scatter_(1, at, special[torch.randint(0, 6, (n, 8), generator=g)])
    visible = torch.rand(n, t, generator=g) < 0.7
    return scores.to(dtype), visible


@pytest.mark.parametrize("n, t, k, dtype, has_width", [
    (3, 200, 8, torch.bfloat16, True),      # two chunks of 128
    (2, 200, 64, torch.float32, True),      # two chunks, k a power of two
    (3, 37, 5, torch.float16, False),       # one chunk, k padded to 8, the whole row seen
    (2, 9, 1, torch.float32, True),
])
def test_the_choice_is_topk_by_key_of_the_masked_row(n, t, k, dtype, has_width):
    scores, visible = tied_rows(n, t, seed=t + k, dtype=dtype)
    width = None
    if has_width:
        width = torch.randint(-1, t + 3, (n,), generator=torch.Generator().manual_seed(k))
        width[0] = t                        # the others below 0, inside or past T (clamped)
    got = indexer_topk(scores, visible, k, use_aiter=False, width=width, kernel=TRITON)
    assert got.dtype == torch.int64 and torch.equal(got, key_choice(scores, visible, k, width))


def test_fewer_visible_than_k_leaves_minus_one():
    scores = torch.tensor([[NAN, 1.0, -0.0, 0.0, -INF, 2.0, 2.0, 5.0, 1.0, 0.5]])
    visible = torch.ones_like(scores, dtype=torch.bool)
    visible[0, 7] = False
    width = torch.tensor([9])
    got = indexer_topk(scores, visible, 10, use_aiter=False, width=width, kernel=TRITON)
    # NaN largest, tied 2.0 and 1.0 by the lower column, -0 and +0 equal, -inf and past width: -1
    assert got.tolist() == [[0, 5, 6, 1, 8, 2, 3, -1, -1, -1]]
    assert torch.equal(got, key_choice(scores, visible, 10, width))


def test_chunking_does_not_change_the_choice():
    """A row of equal values spanning several chunks: the lowest columns win, in order."""
    keep, block = blocks(8)
    t = 2 * block + 5
    scores = torch.full((1, t), 0.25)
    scores[0, t - 1] = 1.0                              # the best in the last, partial chunk
    visible = torch.ones(1, t, dtype=torch.bool)
    got = indexer_topk(scores, visible, 8, use_aiter=False, kernel=TRITON)
    assert got.tolist() == [[t - 1, *range(7)]]


def test_aiter_keeps_its_own_kernel(monkeypatch):
    """use_aiter=True never reaches the Triton kernel (aiter stood in by torch's topk here)."""
    def refuse(*args):
        raise AssertionError("the Triton top-k ran for an aiter call")

    monkeypatch.setattr(aiter_ops, "_topk_aiter", lambda s, k: s.topk(k))
    monkeypatch.setattr(indexer_topk_triton, "indexer_topk_triton", refuse)
    scores = torch.tensor([[1.0, 3.0, 2.0]])
    got = indexer_topk(scores, torch.ones(1, 3, dtype=torch.bool), 2, use_aiter=True,
                       kernel=TRITON)
    assert got.tolist() == [[1, 2]]


def test_one_op_per_call():
    scores, visible = tied_rows(1, 4, seed=2)
    loc, pick = torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64)
    assert op_names(lambda: indexer_topk(scores, visible, 2, use_aiter=False,
                                         kernel=TRITON)) == ["dsv4::indexer_topk"]
    assert op_names(lambda: picked_rows(loc, pick, kernel=TRITON)) == ["dsv4::picked_rows"]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_picked_rows_is_the_gather_byte_for_byte(dtype):
    g = torch.Generator().manual_seed(5)
    loc = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, 2 * 40), generator=g).to(dtype)[:, ::2]
    pick = torch.randint(-1, 40, (5, 7), generator=g)
    pick[0] = -1
    rows, valid = picked_rows(loc, pick, kernel=TRITON)
    assert rows.dtype == dtype and torch.equal(rows, loc.gather(1, pick.clamp(min=0)))
    assert valid.dtype == torch.bool and torch.equal(valid, pick >= 0)
