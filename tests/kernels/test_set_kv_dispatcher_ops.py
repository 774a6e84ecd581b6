"""Each set-KV call is one dispatcher op, torch.ops.dsv4.<name>, whatever backend runs it: what
a GPU launches once is one node for graph capture, torch.compile and the op counters. Each
backend is an overload of the op (torch, triton, and hip for the three fused stores)."""

from dataclasses import asdict

import pytest
import torch

import hip_kernels
from hip_kernels import set_kv_ref as R
from hip_kernels.backend import HIP_OPS
from hip_kernels.library import op, ops
from hip_kernels.numerics import DEFAULT_NUMERICS
from hip_kernels.set_kv import SCHEMAS
from kv_inputs import clone_args, norm_rope_args, same_bytes
from op_recorder import recorded_ops

try:
    from triton_interp_shim import interpreter_shim  # noqa: F401 (autouse fixture)
except ImportError:                                   # no triton: its case is skipped
    pass

STORES = ("fused_k_norm_rope_store", "fused_store_cache", "store_kv_pack", "indexer_store",
          "fused_translate_norm_rope_store")


def test_every_set_kv_op_is_registered_with_its_mutated_arguments_per_backend():
    assert set(SCHEMAS) == set(STORES)
    for name in STORES:
        packet = getattr(ops, name)
        backends = {"torch", "triton"} | ({"hip"} if name in HIP_OPS else set())
        assert set(packet.overloads()) == backends, name
        for overload in packet.overloads():
            schema = getattr(packet, overload)._schema
            written = [a.name for a in schema.arguments
                       if a.alias_info is not None and a.alias_info.is_write]
            assert "cache" in written and len(schema.returns) == 0, (name, overload)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_store_is_one_dispatcher_op_and_writes_the_reference_bytes(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    args = norm_rope_args(seed=4, n=5, page_size=4, pages=3, heads=2)
    want = clone_args(args)
    kernel = hip_kernels.KernelOptions(backend=backend, value_checks=False)
    R.fused_k_norm_rope_store(**want, dialect=kernel.fp8_dialect.name, **asdict(DEFAULT_NUMERICS))
    calls = recorded_ops(lambda: hip_kernels.fused_k_norm_rope_store(**args, kernel=kernel))
    assert [(name, overload) for name, overload, _ in calls] == [
        ("dsv4::fused_k_norm_rope_store", backend)]
    assert same_bytes(args["cache"], want["cache"]) and same_bytes(args["q"], want["q"])


@pytest.mark.parametrize("backend", ["torch", "triton", "hip"])
def test_meta_tensors_trace_without_running_a_kernel(backend):
    """(every backend's overload has the fake implementation; the hip one builds nothing)"""
    args = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
            for k, v in norm_rope_args(seed=1, n=3, page_size=4, pages=2).items()}
    store = getattr(ops.fused_k_norm_rope_store, backend)
    store(args["kv"], args["weight"], 1e-6, args["freqs_cis"], args["positions"],
          args["out_loc"], args["cache"], 4, None, "ocp", True, None, 1e-4, "norm_rope", "exact")
    assert op("fused_k_norm_rope_store", "torch") is ops.fused_k_norm_rope_store.torch


def test_the_ops_numerics_arguments_are_the_store_numerics_fields_in_order():
    from dataclasses import astuple, fields

    from hip_kernels import set_kv
    from hip_kernels.numerics import StoreNumerics

    host = StoreNumerics(round_to_bf16=False, fp8_max=224.0, amax_floor=1e-8, q_mode="rope_only",
                         rms="device")
    assert set_kv._fields(host) == astuple(host)
    for name in ("fused_k_norm_rope_store", "fused_store_cache",
                 "fused_translate_norm_rope_store"):
        arguments = [a.name for a in getattr(ops, name).torch._schema.arguments]
        assert arguments[-6:] == ["dialect"] + [f.name for f in fields(StoreNumerics)], name
