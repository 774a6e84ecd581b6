"""Triton kernels and launchers of the set-KV family. Each launcher is its dispatcher op's triton
backend itself (`set_kv.SCHEMAS`: the same names and arguments as `set_kv_ref`), so a store
reaches its kernel with no frame between the op and the launch.

One program per KV row (plus one per q head when q is fused in). Arguments are checked by the
public ops in `set_kv`; these launchers trust them. Rows whose location is negative (or, for the
translating store, whose SWA slot is unmapped) write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import Q_MODES
from .platform import DIALECTS
from .triton_kv_row import (AMAX_FLOOR, FP32_NAN, INDEX_DIM, INDEX_POW2_AMAX_FLOOR,
                            LAUNCH_OPTIONS, N_TILES, NOPE_DIM, SCALE_BYTES, bf16_rms_inverse,
                            canonical_nan_bf16, fp8_bits, fp8_constexprs, indexer_dim_offsets,
                            indexer_offsets, is_finite, load_nope, load_rope, nope_offsets,
                            quantize_tiles, rms_inverse, rope_offsets, rotate_pairs,
                            rotate_pairs_fma, store_kv_row)


@triton.jit
def _norm_rope_kv_row(kv_row, weight_ptr, eps, freq_row, freq_stride_pair, cache_ptr, loc, keep,
                      PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr,
                      FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_NAN: tl.constexpr,
                      SOFT_FP8: tl.constexpr,
                      TILE_AMAX_FLOOR: tl.constexpr, ROUND_BF16: tl.constexpr,
                      KV_NORM: tl.constexpr, RMS_DEVICE: tl.constexpr):
    nope = load_nope(kv_row).to(tl.float32)
    rope = load_rope(kv_row + NOPE_DIM).to(tl.float32)
    if KV_NORM:
        r = rms_inverse(nope, rope, eps, RMS_DEVICE)
        w_nope = load_nope(weight_ptr).to(tl.float32)
        w_rope = load_rope(weight_ptr + NOPE_DIM).to(tl.float32)
        nope = w_nope * (nope * r)
        rope = w_rope * (rope * r)
    if ROUND_BF16:
        nope = nope.to(tl.bfloat16).to(tl.float32)
        rope = rope.to(tl.bfloat16).to(tl.float32)
    nope_bytes, scale_bytes = quantize_tiles(nope, FP8, FP8_MAX, TILE_AMAX_FLOOR, FP8_NAN,
                                             SOFT_FP8)
    rope = canonical_nan_bf16(rotate_pairs(rope, freq_row, freq_stride_pair))
    store_kv_row(cache_ptr, loc, keep, nope_bytes, rope, scale_bytes, PAGE_SIZE, PAGE_BYTES)


@triton.jit
def _rope_q_head(q_head, freq_row, freq_stride_pair):
    """RoPE only (no norm) of the last 64 dims of one q head, in place, fma-rounded."""
    rope = load_rope(q_head + NOPE_DIM).to(tl.float32)
    tl.store(q_head + NOPE_DIM + rope_offsets(), rotate_pairs_fma(rope, freq_row, freq_stride_pair))


@triton.jit
def _norm_rope_q_head(q_head, eps, freq_row, freq_stride_pair, Q_MODE: tl.constexpr,
                      RMS_DEVICE: tl.constexpr):
    """Weightless RMSNorm + RoPE of one q head [512] bf16, in place. Q_MODE (a Q_MODES index):
    0 the fp32 norm rounded to bf16 before the RoPE; 1 the RoPE takes the fp32 norm; 3 the norm
    op by op in bf16 (the reference's), then the RoPE of those bf16 values."""
    nope = load_nope(q_head).to(tl.float32)
    rope = load_rope(q_head + NOPE_DIM).to(tl.float32)
    if Q_MODE == 3:
        r = bf16_rms_inverse(nope, rope, eps)
    else:
        r = rms_inverse(nope, rope, eps, RMS_DEVICE)
    offs, mask = nope_offsets()
    tl.store(q_head + offs, (nope * r).to(tl.bfloat16), mask=mask)
    rope = rope * r
    if Q_MODE != 1:
        rope = rope.to(tl.bfloat16).to(tl.float32)
    tl.store(q_head + NOPE_DIM + rope_offsets(), rotate_pairs(rope, freq_row, freq_stride_pair))


@triton.jit
def norm_rope_store_kernel(kv_ptr, kv_stride, weight_ptr, eps, freq_ptr, freq_stride_pos,
                           freq_stride_pair, pos_ptr, pos_stride, loc_ptr, loc_stride,
                           full_to_swa_ptr, map_stride, map_len, swa_out_ptr, swa_out_stride,
                           cache_ptr, num_slots, q_ptr, q_stride_row, q_stride_head,
                           PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr,
                           FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_NAN: tl.constexpr,
                           SOFT_FP8: tl.constexpr, TRANSLATE: tl.constexpr,
                           HAS_SWA_OUT: tl.constexpr, HAS_Q: tl.constexpr,
                           TILE_AMAX_FLOOR: tl.constexpr, ROUND_BF16: tl.constexpr,
                           KV_NORM: tl.constexpr, Q_MODE: tl.constexpr,
                           RMS_DEVICE: tl.constexpr = False):
    """Grid (N, 1 + H): program (i, 0) normalizes (KV_NORM), rotates, quantizes and stores kv
    row i; program (i, h + 1) treats q[i, h] in place as Q_MODE says (Q_MODES index), whatever
    row i's location. With TRANSLATE, loc_ptr holds full-pool locations mapped through
    full_to_swa (negative, past the map's map_len entries, or unmapped 0 = skip). Slots at or
    past num_slots write nothing (masked here, whatever the host checked)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + row * pos_stride).to(tl.int64)
    freq_row = freq_ptr + pos * freq_stride_pos
    if head == 0:
        loc = tl.load(loc_ptr + row * loc_stride).to(tl.int64)
        if TRANSLATE:
            in_map = (loc >= 0) & (loc < map_len)
            loc = tl.load(full_to_swa_ptr + loc * map_stride, mask=in_map, other=-1).to(tl.int32)
            if HAS_SWA_OUT:
                tl.store(swa_out_ptr + row * swa_out_stride, loc)
            keep = (loc > 0) & (loc < num_slots)
        else:
            keep = (loc >= 0) & (loc < num_slots)
        _norm_rope_kv_row(kv_ptr + row * kv_stride, weight_ptr, eps, freq_row, freq_stride_pair,
                          cache_ptr, loc, keep, PAGE_SIZE, PAGE_BYTES, FP8, FP8_MAX, FP8_NAN,
                          SOFT_FP8, TILE_AMAX_FLOOR, ROUND_BF16, KV_NORM, RMS_DEVICE)
    else:
        if HAS_Q:
            q_head = q_ptr + row * q_stride_row + (head - 1).to(tl.int64) * q_stride_head
            if Q_MODE == 2:
                _rope_q_head(q_head, freq_row, freq_stride_pair)
            else:
                _norm_rope_q_head(q_head, eps, freq_row, freq_stride_pair, Q_MODE, RMS_DEVICE)


def _norm_rope_launch(kv, weight, eps, freqs_cis, positions, loc, full_to_swa, swa_loc_out,
                      cache, page_size, q, dialect, round_to_bf16, fp8_max, amax_floor, q_mode,
                      rms) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, keyword arguments) of norm_rope_store_kernel for one store: the two
    norm + RoPE launchers differ only in the translation."""
    freqs = torch.view_as_real(freqs_cis)
    heads = 0 if q is None else q.shape[1]
    map_len = 0 if full_to_swa is None else full_to_swa.shape[0]
    translate, has_swa_out = full_to_swa is not None, swa_loc_out is not None
    full_to_swa = loc if full_to_swa is None else full_to_swa      # placeholders when absent
    swa_loc_out = loc if swa_loc_out is None else swa_loc_out
    args = (kv, kv.stride(0), kv if weight is None else weight, float(eps), freqs,
            freqs.stride(0), freqs.stride(1), positions, positions.stride(0), loc, loc.stride(0),
            full_to_swa, full_to_swa.stride(0), map_len, swa_loc_out, swa_loc_out.stride(0),
            cache, cache.shape[0] * page_size, kv if q is None else q,
            0 if q is None else q.stride(0), 0 if q is None else q.stride(1))
    kwargs = dict(PAGE_SIZE=page_size, PAGE_BYTES=cache.stride(0),
                  **fp8_constexprs(DIALECTS[dialect], fp8_max, cache.device),
                  TRANSLATE=translate, HAS_SWA_OUT=has_swa_out, HAS_Q=q is not None,
                  TILE_AMAX_FLOOR=amax_floor, ROUND_BF16=round_to_bf16,
                  KV_NORM=weight is not None, Q_MODE=Q_MODES.index(q_mode),
                  RMS_DEVICE=rms == "device", **LAUNCH_OPTIONS)
    return (kv.shape[0], 1 + heads), args, kwargs


def fused_k_norm_rope_store(kv, weight, eps, freqs_cis, positions, out_loc, cache, page_size,
                            q, dialect, round_to_bf16, fp8_max, amax_floor, q_mode, rms) -> None:
    if kv.shape[0] == 0:
        return
    grid, args, kwargs = _norm_rope_launch(kv, weight, eps, freqs_cis, positions, out_loc, None,
                                           None, cache, page_size, q, dialect, round_to_bf16,
                                           fp8_max, amax_floor, q_mode, rms)
    norm_rope_store_kernel[grid](*args, **kwargs)


def fused_translate_norm_rope_store(kv, weight, eps, freqs_cis, positions, full_loc, full_to_swa,
                                    cache, page_size, swa_loc_out, q, dialect, round_to_bf16,
                                    fp8_max, amax_floor, q_mode, rms) -> None:
    if kv.shape[0] == 0:
        return
    grid, args, kwargs = _norm_rope_launch(kv, weight, eps, freqs_cis, positions, full_loc,
                                           full_to_swa, swa_loc_out, cache, page_size, q,
                                           dialect, round_to_bf16, fp8_max, amax_floor, q_mode,
                                           rms)
    norm_rope_store_kernel[grid](*args, **kwargs)


@triton.jit
def store_cache_kernel(rows_ptr, row_stride, loc_ptr, loc_stride, cache_ptr, num_slots,
                       PAGE_SIZE: tl.constexpr,
                       PAGE_BYTES: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                       FP8_NAN: tl.constexpr, SOFT_FP8: tl.constexpr,
                       TILE_AMAX_FLOOR: tl.constexpr):
    """Quantize and store one already normalized and rotated bf16 row per program."""
    row = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + row * loc_stride).to(tl.int64)
    row_ptr = rows_ptr + row * row_stride
    nope_bytes, scale_bytes = quantize_tiles(load_nope(row_ptr).to(tl.float32), FP8, FP8_MAX,
                                             TILE_AMAX_FLOOR, FP8_NAN, SOFT_FP8)
    store_kv_row(cache_ptr, loc, (loc >= 0) & (loc < num_slots), nope_bytes,
                 canonical_nan_bf16(load_rope(row_ptr + NOPE_DIM)), scale_bytes, PAGE_SIZE,
                 PAGE_BYTES)


def fused_store_cache(rows, cache, out_loc, page_size, dialect, round_to_bf16, fp8_max,
                      amax_floor, q_mode, rms) -> None:
    """The rows arrive normalized and rounded: round_to_bf16, q_mode and rms change nothing."""
    if rows.shape[0] == 0:
        return
    store_cache_kernel[(rows.shape[0],)](
        rows, rows.stride(0), out_loc, out_loc.stride(0), cache, cache.shape[0] * page_size,
        PAGE_SIZE=page_size, PAGE_BYTES=cache.stride(0),
        **fp8_constexprs(DIALECTS[dialect], fp8_max, cache.device),
        TILE_AMAX_FLOOR=amax_floor, **LAUNCH_OPTIONS)


@triton.jit
def store_pack_kernel(nope_ptr, nope_stride, rope_ptr, rope_stride, scales_ptr, scales_stride,
                      loc_ptr, loc_stride, cache_ptr, num_slots, PAGE_SIZE: tl.constexpr,
                      PAGE_BYTES: tl.constexpr):
    """Copy one pre-quantized row (fp8 bytes, bf16 rope, 7 ue8m0 bytes) per program."""
    row = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + row * loc_stride).to(tl.int64)
    nope = load_nope(nope_ptr + row * nope_stride)
    rope = load_rope(rope_ptr + row * rope_stride)
    tile = tl.arange(0, SCALE_BYTES)
    scales = tl.load(scales_ptr + row * scales_stride + tile, mask=tile < N_TILES, other=0)
    store_kv_row(cache_ptr, loc, (loc >= 0) & (loc < num_slots), nope, rope, scales, PAGE_SIZE,
                 PAGE_BYTES)


def store_kv_pack(nope_fp8, rope_bf16, scales, cache, out_loc, page_size) -> None:
    if nope_fp8.shape[0] == 0:
        return
    store_pack_kernel[(nope_fp8.shape[0],)](
        nope_fp8.view(torch.uint8), nope_fp8.stride(0), rope_bf16, rope_bf16.stride(0), scales,
        scales.stride(0), out_loc, out_loc.stride(0), cache, cache.shape[0] * page_size,
        PAGE_SIZE=page_size, PAGE_BYTES=cache.stride(0), **LAUNCH_OPTIONS)


@triton.jit
def indexer_store_kernel(k_ptr, k_stride, loc_ptr, loc_stride, cache_ptr, num_slots,
                         PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                         FP8_NAN: tl.constexpr, SOFT_FP8: tl.constexpr,
                         POW2_SCALE: tl.constexpr = False, KEY_TILE: tl.constexpr = 0):
    """One indexer key [128] per program: fp32 scale max(amax, 1e-4) / FP8_MAX (POW2_SCALE:
    2^ceil(log2(max(amax, 2^-126) / FP8_MAX)) from the fp32 bits), values k / scale cast to
    fp8, in the 132-byte layout with the values in KEY_TILE's order; a key holding a NaN or inf
    is poisoned (FP8_NAN bytes, NaN scale)."""
    row = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + row * loc_stride).to(tl.int64)
    dims = tl.arange(0, INDEX_DIM)
    k = tl.load(k_ptr + row * k_stride + dims).to(tl.float32)
    poisoned = tl.min(is_finite(k).to(tl.int32)) == 0
    if POW2_SCALE:
        amax = tl.where(poisoned, 1.0, tl.maximum(tl.max(tl.abs(k)), INDEX_POW2_AMAX_FLOOR))
        bits = tl.div_rn(amax, tl.full([], FP8_MAX, tl.float32)).to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = tl.where(poisoned, 1.0, ((exp + 127) << 23).to(tl.float32, bitcast=True))
        x = k * ((127 - exp) << 23).to(tl.float32, bitcast=True)     # exact: times 2^-exp
    else:
        amax = tl.where(poisoned, 1.0, tl.maximum(tl.max(tl.abs(k)), AMAX_FLOOR))
        scale = tl.div_rn(amax, tl.full([], FP8_MAX, tl.float32))
        x = tl.div_rn(k, scale)
    q = fp8_bits(tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX), FP8, FP8_NAN, SOFT_FP8)
    q = tl.where(poisoned, FP8_NAN, q).to(tl.uint8)
    scale = tl.where(poisoned, tl.full([], FP32_NAN, tl.int32).to(tl.float32, bitcast=True),
                     scale)
    value_off, scale_off = indexer_offsets(loc, PAGE_SIZE, KEY_TILE)
    keep = (loc >= 0) & (loc < num_slots)
    tl.store(cache_ptr + value_off + indexer_dim_offsets(dims, KEY_TILE), q, mask=keep)
    tl.store((cache_ptr + scale_off).to(tl.pointer_type(tl.float32)), scale, mask=keep)


def indexer_store(k, cache, out_loc, page_size, dialect, pow2_scale, key_tile) -> None:
    if k.shape[0] == 0:
        return
    indexer_store_kernel[(k.shape[0],)](
        k, k.stride(0), out_loc, out_loc.stride(0), cache, cache.shape[0] * page_size,
        PAGE_SIZE=page_size, **fp8_constexprs(DIALECTS[dialect], device=cache.device),
        POW2_SCALE=pow2_scale, KEY_TILE=key_tile, **LAUNCH_OPTIONS)
