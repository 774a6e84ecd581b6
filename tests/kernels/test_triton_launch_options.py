"""Every set-KV Triton launch runs with the options the ahead-of-time report compiles its kernel
with: fp fusion off (a fused multiply-add would change the stored bytes on a GPU; the interpreter
ignores the option, so no byte-exact test here sees it) and the same waves and stages (the
report's registers are those of the kernel that runs). The launches are recorded, not run."""

import pytest
import torch

pytest.importorskip("triton")

import hip_kernels  # noqa: E402
from hip_kernels import KernelOptions, triton_aot  # noqa: E402
from hip_kernels import kv_layout as L  # noqa: E402
from hip_kernels import set_kv_triton as K  # noqa: E402
from hip_kernels.platform import default_device, dialect_for_arch  # noqa: E402
from kv_inputs import (bf16_rows, gen, indexer_cache, kv_cache, locations,  # noqa: E402
                       norm_rope_args, to_device)
from launch_recorder import LaunchRecorder  # noqa: E402
from set_kv_cases import make_case  # noqa: E402

ARCH = "gfx942"


def pack_args():
    g = gen(3)
    nope, rope, scales = L.quantize_kv_rows(bf16_rows(g, 4, L.HEAD_DIM),
                                            KernelOptions().fp8_dialect)
    return dict(nope_fp8=nope, rope_bf16=rope, scales=scales, cache=kv_cache(2, 4),
                out_loc=locations(g, 4, 8), page_size=4)


def indexer_args():
    g = gen(4)
    return dict(k=bf16_rows(g, 4, L.INDEX_DIM), cache=indexer_cache(2, 4),
                out_loc=locations(g, 4, 8), page_size=4)


# public op -> (its kernel in set_kv_triton, the AOT report's variant, its arguments)
LAUNCHES = {
    "fused_k_norm_rope_store": ("norm_rope_store_kernel", "fused_k_norm_rope_store+q",
                                lambda: norm_rope_args(1, 4, 4, 2, heads=2)),
    "fused_translate_norm_rope_store": (
        "norm_rope_store_kernel", "fused_translate_norm_rope_store",
        lambda: make_case("fused_translate_norm_rope_store", 2, 4, 4, 2, 0, torch.int64,
                          torch.bfloat16)),
    "fused_store_cache": ("store_cache_kernel", "fused_store_cache",
                          lambda: make_case("fused_store_cache", 2, 4, 4, 2, 0, torch.int64,
                                            torch.bfloat16)),
    "store_kv_pack": ("store_pack_kernel", "store_kv_pack", pack_args),
    "indexer_store": ("indexer_store_kernel", "indexer_store", indexer_args),
}


def aot_options(monkeypatch, variant):
    """The kernel and the options the AOT report compiles `variant` with (triton.compile
    recorded, as the report calls compile_for)."""
    import triton

    kernel, signature, constexprs, *options = triton_aot._variants(dialect_for_arch(ARCH))[variant]
    handed = []
    with monkeypatch.context() as m:
        m.delenv("TRITON_INTERPRET", raising=False)
        m.setattr(triton, "compile", lambda src, target, options: handed.append(options))
        triton_aot.compile_for(kernel, signature, constexprs, ARCH, *options)
    (compiled,) = handed
    return kernel, compiled


@pytest.mark.parametrize("op", LAUNCHES)
def test_set_kv_launch_uses_the_aot_reports_options(monkeypatch, op):
    kernel_name, variant, make_args = LAUNCHES[op]
    kernel = getattr(K, kernel_name)
    aot_kernel, compiled = aot_options(monkeypatch, variant)
    assert aot_kernel is kernel
    recorder = LaunchRecorder()
    monkeypatch.setattr(K, kernel_name, recorder)
    getattr(hip_kernels, op)(**to_device(make_args(), default_device()),
                             kernel=KernelOptions(backend="triton"))
    ((_, kwargs),) = recorder.launches
    launched = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    assert launched.get("enable_fp_fusion") is False
    assert launched == compiled
