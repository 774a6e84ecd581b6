"""The set-KV family as dispatcher ops (`torch.ops.dsv4.*`, see `library`), one per call whatever
backend runs. The ops take already checked arguments (see `set_kv`, the public entry points,
which check and resolve the backend on the host first): the backend name, the fp8 dialect name
and the `StoreNumerics` fields are plain arguments, so a recorded call replays the same kernel.
The ops only write their mutated arguments: they return nothing.
"""

from __future__ import annotations

from .library import define_op, ops
from .numerics import StoreNumerics
from .platform import DIALECTS

NUMERICS_ARGS = ("bool round_to_bf16, float? fp8_max, float amax_floor, str q_mode, "
                 "str rms=\"exact\"")
SCHEMAS = {
    "fused_k_norm_rope_store": (
        "Tensor kv, Tensor? weight, float eps, Tensor freqs_cis, Tensor positions, "
        "Tensor out_loc, Tensor(a!) cache, int page_size, Tensor(b!)? q, str backend, "
        f"str dialect, {NUMERICS_ARGS}"),
    "fused_store_cache": (
        "Tensor rows, Tensor(a!) cache, Tensor out_loc, int page_size, str backend, "
        f"str dialect, {NUMERICS_ARGS}"),
    "store_kv_pack": (
        "Tensor nope_fp8, Tensor rope_bf16, Tensor scales, Tensor(a!) cache, Tensor out_loc, "
        "int page_size, str backend"),
    "indexer_store": (
        "Tensor k, Tensor(a!) cache, Tensor out_loc, int page_size, str backend, str dialect, "
        "bool pow2_scale=False"),
    "fused_translate_norm_rope_store": (
        "Tensor kv, Tensor? weight, float eps, Tensor freqs_cis, Tensor positions, "
        "Tensor full_loc, Tensor full_to_swa, Tensor(a!) cache, int page_size, "
        f"Tensor(b!)? swa_loc_out, Tensor(c!)? q, str backend, str dialect, {NUMERICS_ARGS}"),
}


def implementation(backend_name: str):
    """The module holding the set-KV ops of a backend."""
    if backend_name == "torch":
        from . import set_kv_ref as mod
    elif backend_name == "triton":
        from . import set_kv_triton as mod
    else:
        from . import set_kv_hip as mod
    return mod


def numerics_args(numerics: StoreNumerics) -> tuple:
    return (numerics.round_to_bf16, numerics.fp8_max, numerics.amax_floor, numerics.q_mode,
            numerics.rms)


def _numerics_kwarg(*args) -> dict:
    """The HIP C++ kernels take no numerics argument when they run the default."""
    numerics = StoreNumerics(*args)
    return {} if numerics.is_default else {"numerics": numerics}


def _fused_k_norm_rope_store(kv, weight, eps, freqs_cis, positions, out_loc, cache, page_size,
                             q, backend, dialect, *numerics):
    implementation(backend).fused_k_norm_rope_store(
        kv, weight, eps, freqs_cis, positions, out_loc, cache, page_size, q, DIALECTS[dialect],
        **_numerics_kwarg(*numerics))


def _fused_store_cache(rows, cache, out_loc, page_size, backend, dialect, *numerics):
    implementation(backend).fused_store_cache(rows, cache, out_loc, page_size, DIALECTS[dialect],
                                              **_numerics_kwarg(*numerics))


def _store_kv_pack(nope_fp8, rope_bf16, scales, cache, out_loc, page_size, backend):
    implementation(backend).store_kv_pack(nope_fp8, rope_bf16, scales, cache, out_loc, page_size)


def _indexer_store(k, cache, out_loc, page_size, backend, dialect, pow2_scale=False):
    implementation(backend).indexer_store(k, cache, out_loc, page_size, DIALECTS[dialect],
                                          pow2_scale)


def _fused_translate_norm_rope_store(kv, weight, eps, freqs_cis, positions, full_loc,
                                     full_to_swa, cache, page_size, swa_loc_out, q, backend,
                                     dialect, *numerics):
    implementation(backend).fused_translate_norm_rope_store(
        kv, weight, eps, freqs_cis, positions, full_loc, full_to_swa, cache, page_size,
        swa_loc_out, DIALECTS[dialect], q=q, **_numerics_kwarg(*numerics))


IMPLS = {"fused_k_norm_rope_store": _fused_k_norm_rope_store,
         "fused_store_cache": _fused_store_cache, "store_kv_pack": _store_kv_pack,
         "indexer_store": _indexer_store,
         "fused_translate_norm_rope_store": _fused_translate_norm_rope_store}


def _no_output(*args, **kwargs) -> None:
    return None


def _define_ops() -> None:
    for name, args in SCHEMAS.items():
        define_op(name, f"({args}) -> ()", IMPLS[name], _no_output)


_define_ops()
