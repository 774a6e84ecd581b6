"""hip_kernels.indexer_topk with each row's candidate count (``width``): the columns past it, a
captured graph's padding, change nothing, ties included. On a CPU the choice is torch's topk
over exactly the first ``width`` columns (the call the reference makes); on a GPU or aiter
(``topk_by_key``) ties go to the lower column, whatever the row length."""

import torch

from hip_kernels.indexer_topk import indexer_topk, topk_by_key

K = 8


def tied_case(pad: int):
    """bf16 scores of 6 rows over 40 candidates (+ pad columns of junk), few distinct values,
    so most picks break ties; visible: a prefix per row; width: the reference's count."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(-3, 4, (6, 40 + pad), generator=g)
    scores[:, :40] = torch.randint(-3, 4, (6, 40), generator=torch.Generator().manual_seed(4))
    scores = scores.to(torch.bfloat16)
    width = torch.tensor([40, 37, 12, 8, 3, 0])
    visible = torch.arange(40 + pad) < torch.tensor([40, 30, 12, 5, 3, 0]).unsqueeze(1)
    return scores, visible, width


def reference_choice(scores, visible, width):
    """The reference's call per row: topk(min(K, width)) over its width, -1 for invisible."""
    out = torch.full((scores.shape[0], K), -1)
    for n, w in enumerate(width.tolist()):
        masked = scores[n, :w].masked_fill(~visible[n, :w], float("-inf"))
        vals, idx = masked.topk(min(K, w))
        out[n, :len(idx)] = idx.masked_fill(vals == float("-inf"), -1)
    return out


def test_a_padded_row_picks_what_torch_picks_at_its_width():
    want = reference_choice(*tied_case(0))
    for pad in (0, 1, 23, 200):
        scores, visible, width = tied_case(pad)
        visible[:, 40:] = False                          # a graph's padding columns
        got = indexer_topk(scores, visible, K, use_aiter=False, width=width)
        assert torch.equal(got, want), pad


def test_without_widths_the_padding_changes_the_ties():
    """What the widths fix: torch's topk over the padded row orders ties another way."""
    scores, visible, width = tied_case(200)
    visible[:, 40:] = False
    assert not torch.equal(indexer_topk(scores, visible, K, use_aiter=False),
                           reference_choice(*tied_case(0)))


def test_the_key_rule_breaks_ties_by_the_lower_column_at_any_length():
    scores, _, _ = tied_case(0)
    vals, idx = topk_by_key(scores, K)
    for n in range(scores.shape[0]):
        order = sorted(range(40), key=lambda c: (-float(scores[n, c]), c))[:K]
        assert idx[n].tolist() == order
    padded = torch.cat([scores, torch.full((6, 100), float("-inf"), dtype=scores.dtype)], 1)
    assert torch.equal(topk_by_key(padded, K)[1], idx)
    signed = torch.tensor([[0.0, -0.0, float("nan"), 1.0]])
    assert topk_by_key(signed, 4)[1].tolist() == [[2, 3, 0, 1]]     # NaN largest, -0 == +0
