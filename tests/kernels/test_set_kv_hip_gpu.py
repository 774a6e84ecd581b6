"""The built HIP/CUDA set-KV extension writes exactly the torch reference's bytes (GPU only).

Runs the public ops with kernel backend=hip in both fp8 dialects; on gfx942 the fnuz
dialect goes through the hardware convert, checked here on every bf16 value. Also captured in
a graph and replayed with new inputs.
"""

import pytest
import torch

import hip_kernels
from hip_kernels import KernelOptions
from hip_kernels.backend import resolve
from hip_kernels.platform import FNUZ, OCP
from kv_inputs import same_bytes
from set_kv_cases import OPS, SHAPES, every_bf16_case, make_case, on_device, outputs, reference

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def extension_built():
    from hip_kernels import set_kv_hip

    reason = set_kv_hip.unavailable_reason()
    assert not reason, reason


def hip(dialect) -> KernelOptions:
    return KernelOptions(backend="hip", fp8_dialect=dialect)


def run_hip(op: str, args: dict, dialect) -> dict:
    assert resolve(op, DEV, "hip") == "hip"
    getattr(hip_kernels, op)(**args, kernel=hip(dialect))
    torch.cuda.synchronize()
    return {k: v.cpu() for k, v in outputs(args).items()}


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert same_bytes(got[k], want[k]), f"{k} differs"


@pytest.mark.parametrize("dialect", [FNUZ, OCP], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_bytes_match_the_reference(op, shape, dialect):
    args = make_case(op, shape, *SHAPES[shape])
    assert_same(run_hip(op, on_device(args, DEV), dialect), reference(op, args, dialect))


def test_fp16_weight_is_widened():
    op = "fused_translate_norm_rope_store"
    args = make_case(op, 5, 8, 2, 8, 0, torch.int32, torch.float16)
    assert_same(run_hip(op, on_device(args, DEV), FNUZ), reference(op, args, FNUZ))


@pytest.mark.parametrize("dialect", [FNUZ, OCP], ids=str)
def test_every_bf16_value_quantizes_like_torch(dialect):
    args, _ = every_bf16_case(dialect)
    got = run_hip("fused_store_cache", on_device(args, DEV), dialect)
    assert_same(got, reference("fused_store_cache", args, dialect))


def test_graph_replay_with_new_inputs():
    op = "fused_k_norm_rope_store"
    first, second = (make_case(op, seed, 16, 64, 2, 2, torch.int64, torch.bfloat16)
                     for seed in (11, 12))
    static = on_device(first, DEV)
    getattr(hip_kernels, op)(**on_device(first, DEV), kernel=hip(OCP))  # warm-up, not captured
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        getattr(hip_kernels, op)(**static, kernel=hip(OCP))
    for name, value in on_device(second, DEV).items():
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    got = {k: v.cpu() for k, v in outputs(static).items()}
    assert_same(got, reference(op, second, OCP))
