"""`torch.ops.dsv4.attention_plan`, the step's metadata in one dispatcher op: its fake (Meta)
implementation, what graph capture and torch.compile see, gives the shapes and dtypes of the real
op's outputs for every call a generate makes (extend, eager decode, captured decode); a decode
planned by its Triton kernel computes the same bits as one planned by its torch body."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.engine import Engine
from hip_kernels.library import ops
from plan_backend import plans_on_triton
from tiny_model import tiny_model


def on_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(on_meta(v) for v in value)
    return value


class RecordPlans(TorchDispatchMode):
    """The overload and arguments of every attention_plan call made inside it."""

    def __enter__(self):
        super().__enter__()
        self.calls = []
        return self.calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is ops.attention_plan:
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_the_fake_gives_the_real_outputs_shapes_and_dtypes(flag_env, graph):
    flag_env()
    engine = Engine(tiny_model(64, seed=0), max_batch=2, max_context_len=64, graph=graph)
    with RecordPlans() as calls:
        engine.generate([list(range(1, 11)), list(range(3, 8))], 3)
    kinds = {(a[3] is None, any(t is None for t in a[11])) for _, a in calls}
    # an extend; a decode step, whose plan covers every token when it is captured
    assert (False, False) in kinds and (True, graph) in kinds
    for func, args in calls:
        want = func(*args)
        got = func(*on_meta(args))
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert (g.device.type, g.shape, g.dtype) == ("meta", w.shape, w.dtype), i


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter on a CPU")
def test_a_decode_planned_by_the_triton_kernel_gives_the_same_bits(flag_env, monkeypatch):
    """Eager decode steps whose plan runs on its Triton kernel (interpreted; every other op and
    the extends' plans on torch) give the logits of plans made by the torch body, bit for bit."""
    pytest.importorskip("triton")
    flag_env()
    model, prompts = tiny_model(64, seed=0), [list(range(1, 11)), list(range(3, 8))]
    want = Engine(model, max_batch=2, max_context_len=64, graph=False).generate(
        prompts, 4, return_logits=True)
    ran = plans_on_triton(monkeypatch)
    got = Engine(model, max_batch=2, max_context_len=64, graph=False).generate(
        prompts, 4, return_logits=True)
    assert ran == {"triton", "torch"}       # the decodes' plans, the extends'
    assert got.tokens == want.tokens
    assert torch.equal(got.logits.view(torch.int32), want.logits.view(torch.int32))
