"""The CPU graph emulation: replay re-runs exactly the recorded tensor ops on the captured tensors,
Python-side state is frozen at capture, and host synchronization inside capture is refused."""

import os

import pytest
import torch

import hip_kernels.capture
from dsv4.graphs import currently_capturing, emulation
from dsv4.graphs.emulation import EmulatedGraph, GraphCaptureError, graph
from op_recorder import op_names


def capture(fn):
    g = EmulatedGraph()
    with graph(g):
        out = fn()
    return g, out


def test_replay_matches_eager_on_new_input_values():
    x = torch.randn(4, 3)
    w = torch.randn(3, 5)
    acc = torch.zeros(5)

    def step():
        y = torch.relu(x @ w + 1)
        acc.add_(y.sum(0))  # in place, on a tensor made before capture
        return y.softmax(-1)

    g, out = capture(step)
    for _ in range(3):
        x.copy_(torch.randn(4, 3))
        acc_before = acc.clone()
        g.replay()
        expected = torch.relu(x @ w + 1)
        torch.testing.assert_close(out, expected.softmax(-1), rtol=0, atol=0)
        torch.testing.assert_close(acc, acc_before + expected.sum(0), rtol=0, atol=0)


def test_factory_tensor_made_in_capture_is_refilled_at_every_replay():
    x = torch.arange(4.0)
    idx = torch.tensor([0, 0, 1, 3])

    def step():
        buf = torch.zeros(4)
        buf.index_add_(0, idx, x)
        return buf

    g, buf = capture(step)
    g.replay()
    g.replay()
    assert buf.tolist() == [1.0, 2.0, 0.0, 3.0]  # refilled with zeros, not accumulated


def test_views_share_storage_and_are_not_rerun():
    x = torch.arange(6.0)

    def step():
        fresh = x * 10
        return fresh.view(2, 3).t()[1:], x.view(3, 2)[0]

    g, (view_of_fresh, view_of_input) = capture(step)
    x.copy_(torch.arange(6.0, 12.0))
    g.replay()
    assert torch.equal(view_of_fresh, (x * 10).view(2, 3).t()[1:])
    assert torch.equal(view_of_input, torch.tensor([6.0, 7.0]))
    views = [op for op in g.ops if op.func.overloadpacket.__name__ in ("view", "t", "slice")]
    assert views and not any(op.rerun for op in views)


def test_multi_output_and_out_ops_replay():
    x = torch.randn(8)
    out = torch.empty(8)

    def step():
        torch.mul(x, 2, out=out)
        return x.topk(3)

    g, (values, indices) = capture(step)
    x.copy_(torch.randn(8))
    g.replay()
    expected = x.topk(3)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)
    assert torch.equal(out, x * 2)


def test_an_op_with_a_matching_out_overload_replays_as_one_launch_into_its_static_output():
    """Replay writes an allocating op's result straight into the captured tensor through the
    out= overload taking the same arguments (names and types): one launch per op, no second
    allocation and no copy, as a kernel writes graph memory. add's Tensor and Scalar overloads
    each find their own (add.out, add.Scalar_out)."""
    x, y = torch.randn(4), torch.randn(4)
    g, (added, added_scalar, squared) = capture(lambda: (
        torch.add(x, y), torch.ops.aten.add.Scalar(x, 1.5), torch.pow(x, 2)))
    assert [str(op.out_func) for op in g.ops] == [
        "aten.add.out", "aten.add.Scalar_out", "aten.pow.Tensor_Scalar_out"]
    x.copy_(torch.randn(4))
    y.copy_(torch.randn(4))
    assert op_names(g.replay) == ["aten::add", "aten::add", "aten::pow"]
    assert torch.equal(added, x + y) and torch.equal(added_scalar, x + 1.5)
    assert torch.equal(squared, x * x)


def test_python_state_is_frozen_at_capture():
    """A dict cache consulted during capture is not consulted at replay; the gather recorded at
    capture re-reads the live locations (the SWA location cache's situation)."""
    table = torch.arange(100, 120)
    loc = torch.tensor([1, 2, 3])
    cache, lookups = {}, []

    def translate(t):
        key = (t.data_ptr(), t.numel())
        lookups.append(key)
        if key not in cache:
            cache[key] = table[t]
        return cache[key]

    g, translated = capture(lambda: translate(loc) + 0)
    assert len(lookups) == 1 and len(cache) == 1
    loc.copy_(torch.tensor([7, 8, 9]))
    g.replay()
    assert len(lookups) == 1  # the Python lookup did not run again
    assert translated.tolist() == [107, 108, 109]  # the recorded gather did


def test_branch_taken_at_capture_is_what_replays():
    x = torch.ones(2)
    mode = {"double": True}

    def step():
        if mode["double"]:
            x.mul_(2)
        else:
            x.add_(100)

    g, _ = capture(step)
    mode["double"] = False
    g.replay()
    assert x.tolist() == [4.0, 4.0]


def test_op_that_may_alias_but_allocates_is_refilled():
    """aten.to's schema says its result may alias self; for a dtype change it allocates."""
    ids = torch.tensor([1, 2])
    with torch.inference_mode():
        g, as_float = capture(lambda: ids.float())
    ids.copy_(torch.tensor([5, 6]))
    g.replay()
    assert as_float.tolist() == [5.0, 6.0]


def test_rng_ops_draw_fresh_numbers_at_each_replay():
    torch.manual_seed(0)
    first, second = torch.rand(3), torch.rand(3)
    torch.manual_seed(0)
    g, r = capture(lambda: torch.rand(3))
    assert torch.equal(r, first)
    g.replay()
    assert torch.equal(r, second)


def test_replay_of_tensors_captured_under_inference_mode():
    x = torch.randn(3)
    with torch.inference_mode():
        g, y = capture(lambda: x.exp())
    x.copy_(torch.randn(3))
    g.replay()
    assert torch.equal(y, x.exp())


x_i = torch.tensor([0, 3, 0, 5])
x_f = torch.tensor([0.5, -1.0, 2.0, 3.0])

HOST_SYNCS = {
    "item": (lambda: x_f[0].item(), "item"),
    "int()": (lambda: int(x_i[1]), "item"),
    "bool()": (lambda: bool(x_f[0] > 0), "bool"),
    "if tensor": (lambda: 1 if (x_f > 0).any() else 0, "_local_scalar_dense"),
    "tolist": (lambda: x_i.tolist(), r"Tensor\.tolist\(\) copies tensor data to the host"),
    "numpy": (lambda: x_f.numpy(), r"Tensor\.numpy\(\) reads tensor data on the host"),
    "nonzero": (lambda: x_i.nonzero(), "nonzero"),
    "where(cond)": (lambda: torch.where(x_i > 0), "nonzero"),
    "bool-mask index": (lambda: x_f[x_f > 0], "boolean-mask indexing"),
    "bool-mask assign": (lambda: x_f.clone().__setitem__(x_f > 0, 0.0), "boolean-mask indexing"),
    "masked_select": (lambda: x_f.masked_select(x_f > 0), "masked_select"),
    "unique": (lambda: torch.unique(x_i), "unique"),
    "repeat_interleave": (lambda: torch.repeat_interleave(x_f, x_i), "repeat_interleave"),
    "bincount": (lambda: torch.bincount(x_i), "bincount"),
    "equal": (lambda: torch.equal(x_f, x_f), "equal"),
}


@pytest.mark.parametrize("name", list(HOST_SYNCS))
def test_host_sync_inside_capture_raises_naming_the_op(name):
    fn, op_name = HOST_SYNCS[name]
    g = EmulatedGraph()
    with pytest.raises(GraphCaptureError, match=op_name):
        with graph(g):
            fn()
    # the failed capture left nothing behind
    assert not emulation.is_capturing() and not currently_capturing()
    assert x_i.tolist() == [0, 3, 0, 5]
    with pytest.raises(RuntimeError, match="not been captured"):
        g.replay()
    assert g.pool().graphs == 0


def test_data_independent_variants_are_allowed():
    g, (a, b, c) = capture(lambda: (
        torch.repeat_interleave(x_f, x_i, output_size=8),
        torch.where(x_f > 0, x_f, torch.zeros_like(x_f)),
        x_f[x_i.clamp(max=3)]))
    g.replay()
    assert a.shape == (8,) and b.tolist() == [0.5, 0.0, 2.0, 3.0] and c.shape == (4,)


def test_triton_launch_inside_capture_is_refused():
    triton = pytest.importorskip("triton")
    import triton.language as tl
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (CPU run)")

    @triton.jit
    def double(ptr, n: tl.constexpr):
        offs = tl.arange(0, n)
        tl.store(ptr + offs, tl.load(ptr + offs) * 2)

    x = torch.ones(4)
    with pytest.raises(GraphCaptureError, match="Triton"):
        with graph(EmulatedGraph()):
            double[(1,)](x, 4)
    double[(1,)](x, 4)  # allowed again after capture
    assert x.tolist() == [2.0] * 4


def test_capture_state_is_visible_to_kernels_and_pools():
    seen = []
    capture(lambda: seen.append((emulation.is_capturing(), currently_capturing(),
                                 hip_kernels.capture.is_capturing())))
    assert seen == [(True, True, True)]
    assert not currently_capturing() and not hip_kernels.capture.is_capturing()


def test_captures_do_not_nest_and_replay_needs_a_capture():
    with graph(EmulatedGraph()):
        with pytest.raises(GraphCaptureError, match="already running"):
            EmulatedGraph().capture_begin()
    with pytest.raises(RuntimeError, match="not been captured"):
        EmulatedGraph().replay()


def test_graphs_share_a_pool_and_recapture_after_reset():
    x = torch.ones(3)
    g1, y1 = capture(lambda: x + 1)
    g2 = EmulatedGraph()
    with graph(g2, pool=g1.pool()):
        y2 = x * 3
    assert g2.pool() is g1.pool()
    assert g1.pool().graphs == 2 and g1.pool().static_bytes == 2 * 3 * 4
    with pytest.raises(RuntimeError, match="reset"):
        g1.capture_begin()
    g1.reset()
    with graph(g1):
        y3 = x - 1
    x.fill_(5)
    for g in (g1, g2):
        g.replay()
    assert y2.tolist() == [15.0] * 3 and y3.tolist() == [4.0] * 3
