"""The set-KV family: the public stores (check the arguments, resolve the backend, run one
dispatcher op) and their ops, `torch.ops.dsv4.<name>` (`SCHEMAS`), one per call whichever
backend runs it: the torch reference (`set_kv_ref`), Triton (`set_kv_triton`) or, for the three
fused stores, HIP C++ (`set_kv_hip`), each backend's function registered as the op's overload
of that backend (see `library`).

All writers skip rows whose location is negative. `kernel` (a `KernelOptions`) picks the
backend, the host checks and the fp8 dialect. K/V holding NaN or inf is stored poisoned, the
same bytes in every backend (see `kv_layout`), or refused with `kernel.refuse_nonfinite`. Every
check happens before any cache byte is written; with value checks on, a slot >= 1 given twice
in one call is refused (off: which row lands is undefined; the dummy slot 0 may always repeat).
`numerics` (a `numerics.StoreNumerics`) makes a store write what another writer of the same
layout writes; the default is this project's numerics.

The ops take already checked arguments: the fp8 dialect's name and the StoreNumerics fields are
plain arguments, so a recorded call replays the same kernel. They only write their mutated
arguments: they return nothing.
"""

from __future__ import annotations

import torch

from . import kv_layout as L
from . import set_kv_ref
from .backend import HIP_OPS, resolve
from .checks import (check_cache, check_eps, check_finite, check_kv_cache, check_locations,
                     check_kernel, check_page_size, check_positions, check_slot_values,
                     check_tensor, value_checks_enabled)
from .library import define_op, op
from .numerics import DEFAULT_NUMERICS, REFERENCE_NUMERICS, StoreNumerics
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from .set_kv_ref import translate_full_to_swa

FLOATS = (torch.bfloat16, torch.float16, torch.float32)

NUMERICS_ARGS = "bool round_to_bf16, float? fp8_max, float amax_floor, str q_mode, str rms"
SCHEMAS = {
    "fused_k_norm_rope_store": (
        "Tensor kv, Tensor? weight, float eps, Tensor freqs_cis, Tensor positions, "
        "Tensor out_loc, Tensor(a!) cache, int page_size, Tensor(b!)? q, str dialect, "
        f"{NUMERICS_ARGS}"),
    "fused_store_cache": (
        f"Tensor rows, Tensor(a!) cache, Tensor out_loc, int page_size, str dialect, "
        f"{NUMERICS_ARGS}"),
    "store_kv_pack": (
        "Tensor nope_fp8, Tensor rope_bf16, Tensor scales, Tensor(a!) cache, Tensor out_loc, "
        "int page_size"),
    "indexer_store": (
        "Tensor k, Tensor(a!) cache, Tensor out_loc, int page_size, str dialect, "
        "bool pow2_scale, int key_tile"),
    "fused_translate_norm_rope_store": (
        "Tensor kv, Tensor? weight, float eps, Tensor freqs_cis, Tensor positions, "
        "Tensor full_loc, Tensor full_to_swa, Tensor(a!) cache, int page_size, "
        f"Tensor(b!)? swa_loc_out, Tensor(c!)? q, str dialect, {NUMERICS_ARGS}"),
}


def _no_output(*args) -> None:
    return None


def _define_ops() -> None:
    for name, args in SCHEMAS.items():
        define_op(name, f"({args}) -> ()", getattr(set_kv_ref, name), _no_output,
                  triton=f"set_kv_triton.{name}",
                  hip=f"set_kv_hip.{name}" if name in HIP_OPS else None)


_define_ops()


def _check_norm_rope_args(kv, weight, eps, freqs_cis, positions, cache, page_size, kernel):
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, L.HEAD_DIM), last_contiguous=True)
    check_eps(eps)
    dev = kv.device
    if weight is not None:
        check_tensor("weight", weight, dtypes=FLOATS, shape=(L.HEAD_DIM,), device=dev,
                     last_contiguous=True)
    check_tensor("freqs_cis", freqs_cis, dtype=torch.complex64, shape=(None, L.ROPE_DIM // 2),
                 device=dev)
    check_positions(positions, kv.shape[0], freqs_cis.shape[0], dev, kernel)
    check_kv_cache("cache", cache, page_size, dev)
    check_finite("kv", kv, kernel)


def _check_q(q, n, dev):
    if q is None:
        return
    check_tensor("q", q, dtype=torch.bfloat16, dim=3, device=dev, last_contiguous=True)
    if q.shape[0] != n or q.shape[2] != L.HEAD_DIM:
        raise ValueError(f"q must have shape [{n}, H, {L.HEAD_DIM}], got {tuple(q.shape)}")


def _hip_ok(numerics: StoreNumerics, cache, has_weight: bool = True) -> bool:
    """The HIP C++ kernels run the default numerics or the reference's (REFERENCE_NUMERICS),
    with a weight, on contiguous caches."""
    return (numerics in (DEFAULT_NUMERICS, REFERENCE_NUMERICS) and cache.is_contiguous()
            and has_weight)


def _fields(numerics: StoreNumerics) -> tuple:
    """The StoreNumerics fields in the ops' order (NUMERICS_ARGS)."""
    return (numerics.round_to_bf16, numerics.fp8_max, numerics.amax_floor, numerics.q_mode,
            numerics.rms)


def _check_numerics(numerics, kernel: KernelOptions) -> StoreNumerics:
    """numerics, a StoreNumerics whose fp8_max the kernel's FP8 dialect can hold (kernel
    checked first)."""
    check_kernel(kernel)
    if not isinstance(numerics, StoreNumerics):
        raise TypeError(f"numerics must be a hip_kernels.StoreNumerics, got "
                        f"{type(numerics).__name__}")
    numerics.fp8_max_for(kernel.fp8_dialect)
    return numerics


def fused_k_norm_rope_store(kv, weight, eps, freqs_cis, positions, out_loc, cache, page_size,
                            q=None, numerics: StoreNumerics = DEFAULT_NUMERICS, *,
                            kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> None:
    """RMSNorm(kv)*weight, RoPE on dims 448..511, FP8-quantize dims 0..447, store at out_loc.
    weight None: kv arrives normalized (RoPE and store only). With q [N, H, 512], also applies
    the weightless per-head RMSNorm + RoPE to q in place (as numerics.q_mode says), for every
    row, whatever its location."""
    _check_numerics(numerics, kernel)
    _check_norm_rope_args(kv, weight, eps, freqs_cis, positions, cache, page_size, kernel)
    _check_q(q, kv.shape[0], kv.device)
    check_locations("out_loc", out_loc, kv.shape[0], cache.shape[0] * page_size, kv.device,
                    kernel)
    backend = resolve("fused_k_norm_rope_store", kv.device, kernel.backend,
                      hip_ok=_hip_ok(numerics, cache, weight is not None))
    op("fused_k_norm_rope_store", backend)(kv, weight, float(eps), freqs_cis, positions, out_loc,
                                           cache, page_size, q, kernel.fp8_dialect.name,
                                           *_fields(numerics))


def fused_store_cache(rows, cache, out_loc, page_size,
                      numerics: StoreNumerics = DEFAULT_NUMERICS, *,
                      kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> None:
    """Quantize already normalized and rotated rows [N, 512] bf16 and store them at out_loc."""
    _check_numerics(numerics, kernel)
    check_tensor("rows", rows, dtype=torch.bfloat16, shape=(None, L.HEAD_DIM), last_contiguous=True)
    check_kv_cache("cache", cache, page_size, rows.device)
    check_locations("out_loc", out_loc, rows.shape[0], cache.shape[0] * page_size, rows.device,
                    kernel)
    check_finite("rows", rows, kernel)
    backend = resolve("fused_store_cache", rows.device, kernel.backend,
                      hip_ok=_hip_ok(numerics, cache))
    op("fused_store_cache", backend)(rows, cache, out_loc, page_size, kernel.fp8_dialect.name,
                                     *_fields(numerics))


def store_kv_pack(nope_fp8, rope_bf16, scales, cache, out_loc, page_size, *,
                  kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> None:
    """Store a pre-quantized pack: nope [N, 448] fp8 (platform dialect), rope [N, 64] bf16,
    scales [N, 7] uint8 ue8m0."""
    check_kernel(kernel)
    d = kernel.fp8_dialect
    check_tensor("nope_fp8", nope_fp8, dtype=d.torch_dtype, shape=(None, L.NOPE_DIM),
                 last_contiguous=True)
    n, dev = nope_fp8.shape[0], nope_fp8.device
    check_tensor("rope_bf16", rope_bf16, dtype=torch.bfloat16, shape=(n, L.ROPE_DIM), device=dev,
                 last_contiguous=True)
    check_tensor("scales", scales, dtype=torch.uint8, shape=(n, L.N_TILES), device=dev,
                 last_contiguous=True)
    check_kv_cache("cache", cache, page_size, dev)
    check_locations("out_loc", out_loc, n, cache.shape[0] * page_size, dev, kernel)
    backend = resolve("store_kv_pack", dev, kernel.backend)
    op("store_kv_pack", backend)(nope_fp8, rope_bf16, scales, cache, out_loc, page_size)


def indexer_store(k, cache, out_loc, page_size, pow2_scale: bool = False, *, key_tile: int = 0,
                  kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> None:
    """Quantize indexer keys [N, 128] (fp32 scale per row) into the 132-byte indexer layout.
    pow2_scale: the scale is a power of two (2^ceil(log2(amax / FP8_MAX))), so FP4-simulated
    keys (e2m1 values times a power of two) read back exactly; else amax / FP8_MAX. key_tile:
    the order of the values in a page (`kv_layout.INDEX_KEY_TILES`: 0 row-major, 16 keys in
    16 x 16 tiles)."""
    check_kernel(kernel)
    check_tensor("k", k, dtypes=FLOATS, shape=(None, L.INDEX_DIM), last_contiguous=True)
    check_page_size(page_size)
    L.check_key_tile(key_tile, page_size)
    check_cache("cache", cache, L.indexer_page_bytes(page_size), page_size, k.device)
    check_locations("out_loc", out_loc, k.shape[0], cache.shape[0] * page_size, k.device,
                    kernel)
    check_finite("k", k, kernel)
    if not isinstance(pow2_scale, bool):
        raise TypeError(f"pow2_scale must be a bool, got {type(pow2_scale).__name__}")
    backend = resolve("indexer_store", k.device, kernel.backend)
    op("indexer_store", backend)(k, cache, out_loc, page_size, kernel.fp8_dialect.name, pow2_scale,
                                 key_tile)


def fused_translate_norm_rope_store(kv, weight, eps, freqs_cis, positions, full_loc, full_to_swa,
                                    cache, page_size, swa_loc_out=None, q=None,
                                    numerics: StoreNumerics = DEFAULT_NUMERICS, *,
                                    kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> None:
    """As fused_k_norm_rope_store (q and numerics included), but translates full-pool locations
    through full_to_swa inside the kernel. Negative full locations and unmapped (0) slots write
    nothing. swa_loc_out [N] int32, if given, receives the translated slots (-1 for negative
    locations)."""
    _check_numerics(numerics, kernel)
    _check_norm_rope_args(kv, weight, eps, freqs_cis, positions, cache, page_size, kernel)
    n, dev = kv.shape[0], kv.device
    _check_q(q, n, dev)
    check_tensor("full_to_swa", full_to_swa, dtypes=(torch.int32, torch.int64), dim=1, device=dev)
    check_locations("full_loc", full_loc, n, full_to_swa.shape[0], dev, kernel)
    if swa_loc_out is not None:
        check_tensor("swa_loc_out", swa_loc_out, dtype=torch.int32, shape=(n,), device=dev)
    if n and value_checks_enabled(kernel):
        capacity = cache.shape[0] * page_size
        check_slot_values("full_loc (through full_to_swa)", translate_full_to_swa(
            full_loc, full_to_swa), capacity, "full_to_swa maps a location of full_loc to SWA "
            f"slot {{hi}} but the cache has {capacity} slots")
    backend = resolve("fused_translate_norm_rope_store", dev, kernel.backend,
                      hip_ok=_hip_ok(numerics, cache, weight is not None))
    op("fused_translate_norm_rope_store", backend)(
        kv, weight, float(eps), freqs_cis, positions, full_loc, full_to_swa, cache, page_size,
        swa_loc_out, q, kernel.fp8_dialect.name, *_fields(numerics))
