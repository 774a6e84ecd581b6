"""Cases of the three set-KV ops the HIP C++ kernel implements, as keyword arguments of the
public ops, plus their torch-reference result. Shared by the CPU harness test and the GPU test."""

from __future__ import annotations

from dataclasses import asdict

import torch

from hip_kernels import kv_layout as L
from hip_kernels import set_kv_ref as R
from hip_kernels.numerics import DEFAULT_NUMERICS
from kv_inputs import bf16_rows, clone_args, gen, kv_cache, locations, norm_rope_args

OPS = ("fused_k_norm_rope_store", "fused_store_cache", "fused_translate_norm_rope_store")

# (n, page_size, pages, q heads, location dtype, weight dtype)
SHAPES = [
    (1, 1, 2, 0, torch.int32, torch.bfloat16),
    (8, 2, 8, 2, torch.int64, torch.float32),
    (33, 64, 2, 3, torch.int32, torch.bfloat16),
    (64, 256, 1, 0, torch.int64, torch.bfloat16),
]


def make_case(op: str, seed: int, n: int, page_size: int, pages: int, heads: int, loc_dtype,
              weight_dtype) -> dict:
    if op == "fused_store_cache":
        g = gen(seed)
        return dict(rows=bf16_rows(g, n, L.HEAD_DIM, pad=64), cache=kv_cache(pages, page_size),
                    out_loc=locations(g, n, pages * page_size, loc_dtype), page_size=page_size)
    args = norm_rope_args(seed, n, page_size, pages, heads, loc_dtype, weight_dtype)
    if op == "fused_k_norm_rope_store":
        return args
    del args["out_loc"]
    args.update(translation(seed, n, pages * page_size, loc_dtype))
    return args


def translation(seed: int, n: int, swa_slots: int, loc_dtype) -> dict:
    """full_loc / full_to_swa / swa_loc_out for n rows: full locations mapped to distinct SWA
    slots >= 1, some negative (-1) and, for n > 2, one that is unmapped (maps to 0)."""
    g = gen(seed + 1000)
    swa_loc = locations(g, n, swa_slots - 1, loc_dtype)
    swa_loc[swa_loc >= 0] += 1
    capacity = 4 * swa_slots + 8
    full_loc = torch.randperm(capacity, generator=g)[:len(swa_loc)].to(swa_loc.dtype)
    full_to_swa = torch.zeros(capacity, dtype=torch.int32 if seed % 2 else torch.int64)
    keep = swa_loc >= 0
    full_to_swa[full_loc[keep].long()] = swa_loc[keep].to(full_to_swa.dtype)
    full_loc[~keep] = -1
    if len(full_loc) > 2 and keep[2]:
        full_to_swa[full_loc[2].long()] = 0  # a row whose location is unmapped
    return dict(full_loc=full_loc, full_to_swa=full_to_swa,
                swa_loc_out=torch.full((len(swa_loc),), 12345, dtype=torch.int32))


def every_bf16_case(dialect) -> dict:
    """fused_store_cache arguments whose 64-wide tiles each hold FP8_MAX (so every scale is 2^0)
    and 63 of the bf16 values in [-FP8_MAX, FP8_MAX]: every value the fp8 conversion can see,
    -0, subnormals and ties included. Also returns the number of tiles that hold values."""
    values = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[values.float().abs() <= dialect.max]
    per_tile = L.TILE - 1
    tiles = -(-len(values) // per_tile)
    body = torch.zeros(tiles * per_tile, dtype=torch.bfloat16)
    body[:len(values)] = values
    nope = torch.zeros(-(-tiles // L.N_TILES) * L.N_TILES, L.TILE, dtype=torch.bfloat16)
    nope[:tiles] = torch.cat([torch.full((tiles, 1), dialect.max, dtype=torch.bfloat16),
                              body.view(tiles, per_tile)], 1)
    n = len(nope) // L.N_TILES
    rope = torch.zeros(n, L.ROPE_DIM, dtype=torch.bfloat16)
    rows = torch.cat([nope.view(n, L.NOPE_DIM), rope], 1)
    return dict(rows=rows, cache=torch.zeros(n, L.page_bytes(1), dtype=torch.uint8),
                out_loc=torch.arange(n), page_size=1), tiles


def on_device(args: dict, device) -> dict:
    """Copies of the tensors on device; views with a unit inner stride keep their strides."""
    out = {}
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
            out[k].copy_(v)
        else:
            out[k] = v
    return out


def reference(op: str, args: dict, dialect) -> dict:
    """The op's outputs (cache, and q or swa_loc_out where present) from the torch reference,
    computed on CPU copies with the default numerics."""
    ref = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in clone_args(args).items()}
    fn = getattr(R, op)
    if op != "fused_store_cache":
        ref.setdefault("q", None)
    if op == "fused_translate_norm_rope_store":
        ref.setdefault("swa_loc_out", None)
    fn(**ref, dialect=dialect.name, **asdict(DEFAULT_NUMERICS))
    return outputs(ref)


def outputs(args: dict) -> dict:
    return {k: args[k] for k in ("cache", "q", "swa_loc_out") if args.get(k) is not None}


NEG_NAN = torch.tensor([0xFFC1], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[0]
# (row, dim, value): a NaN in tile 1; -inf in tile 0 and a negative NaN with a payload among the
# RoPE dims; +inf among the RoPE dims. Rows 3 and up stay finite.
NONFINITE = ((0, 70, float("nan")), (1, 5, float("-inf")), (1, 470, NEG_NAN), (2, 500, float("inf")))


def with_nonfinite(op: str, args: dict) -> dict:
    """A copy of a case (at least 4 rows) whose source rows hold the NONFINITE values."""
    a = clone_args(args)
    src = a["rows" if op == "fused_store_cache" else "kv"]
    for row, dim, value in NONFINITE:
        src[row, dim] = value
    return a


def nonfinite_case(op: str, page_size: int, seed: int = 3) -> tuple[dict, torch.Tensor]:
    """Six rows written to distinct slots (none skipped; q heads for the fused op) with the
    NONFINITE values, and the slot each row lands on."""
    args = make_case(op, seed, 6, page_size, 4, 2 if op == "fused_k_norm_rope_store" else 0,
                     torch.int64, torch.bfloat16)
    slots = torch.randperm(4 * page_size, generator=gen(seed))[:6]
    if op == "fused_translate_norm_rope_store":
        slots = slots + 1                                   # SWA slot 0 means unmapped
        args["full_loc"] = torch.arange(6) * 3 + 1
        args["full_to_swa"] = torch.zeros(40, dtype=torch.int64)
        args["full_to_swa"][args["full_loc"]] = slots
    else:
        args["out_loc"] = slots
    return with_nonfinite(op, args), slots
