"""Token choice: greedy is an argmax; top-k and top-p restrict the draw; a seed repeats it."""

import pytest
import torch

from dsv4.sampling import GREEDY, SamplingParams, sample


def logits():
    return torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0], [5.0, 0.0, 4.9, 0.0, 0.0]])


def draws(params, n=400):
    g = torch.Generator().manual_seed(params.seed)
    return [tuple(sample(logits(), params, g)) for _ in range(n)]


def test_greedy_is_the_argmax():
    assert sample(logits(), GREEDY, None) == [1, 0]
    assert GREEDY.greedy and not SamplingParams(temperature=0.5).greedy


def test_top_k_and_top_p_restrict_the_draw():
    top1 = draws(SamplingParams(temperature=2.0, top_k=1))
    assert set(top1) == {(1, 0)}
    top2 = draws(SamplingParams(temperature=2.0, top_k=2))
    assert {t[0] for t in top2} == {1, 3} and {t[1] for t in top2} == {0, 2}
    # row 0 probabilities: 1: 0.474, 3: 0.429, 2: 0.064, 0: 0.024, 4: 0.009. With top_p 0.95,
    # 1 and 3 (0.904) do not reach it, so 2 stays in; with 2 (0.968) they do: 0 and 4 are out.
    nucleus = draws(SamplingParams(temperature=1.0, top_p=0.95))
    assert {t[0] for t in nucleus} == {1, 2, 3}
    assert {t[0] for t in draws(SamplingParams(temperature=1.0, top_p=0.01))} == {1}


def test_a_seed_repeats_the_draw_and_another_seed_differs():
    a = draws(SamplingParams(temperature=1.0, seed=5), n=50)
    assert a == draws(SamplingParams(temperature=1.0, seed=5), n=50)
    assert a != draws(SamplingParams(temperature=1.0, seed=6), n=50)


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
])
def test_bad_parameters_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)
