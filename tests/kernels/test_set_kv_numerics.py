"""Numerics of the set-KV ops, for every backend, against an independent fp32 computation.

- nope dims: the dequantized cache is within one fp8 step (at that magnitude, times the tile's
  scale) of fp32 RMSNorm, and each tile's scale is the smallest power of two that fits;
- RoPE dims (cache and q): within 1 bf16 ulp of the fp32 rotation of the bf16 normalized values;
- q nope dims: within 1 bf16 ulp of fp32 x * r;
- indexer keys: within one fp8 step times the row's fp32 scale.
"""

import numpy as np
import pytest
import torch

import hip_kernels
from hip_kernels import KernelOptions
from hip_kernels import kv_layout as L
from hip_kernels.platform import DIALECTS, default_device
from kv_inputs import bf16_rows, clone_args, gen, indexer_cache, norm_rope_args, to_device

DEV = default_device()
BACKENDS = ["torch", "triton"]
FP8_MIN_NORMAL_EXP = {"fnuz": -7, "ocp": -6}
FP8_MANTISSA_BITS = 3

try:
    from triton_interp_shim import interpreter_shim  # noqa: F401 (autouse fixture)
except ImportError:  # no triton here: the triton cases skip
    pass


def use_backend(backend, dialect) -> KernelOptions:
    """The KernelOptions that run `backend`, with caches in the fp8 `dialect`."""
    if backend == "triton":
        pytest.importorskip("triton")
    return KernelOptions(backend=backend, fp8_dialect=DIALECTS[dialect])


def bf16(x: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t.to(torch.bfloat16).float().numpy()


def ulp_bf16(v: np.ndarray) -> np.ndarray:
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -126)))
    return 2.0 ** (e - 7)


def fp8_step(m: np.ndarray, dialect: str) -> np.ndarray:
    """Spacing of e4m3 values at magnitude m (subnormal spacing below the smallest normal)."""
    e = np.floor(np.log2(np.maximum(m, 2.0 ** -30)))
    return 2.0 ** (np.maximum(e, FP8_MIN_NORMAL_EXP[dialect]) - FP8_MANTISSA_BITS)


def rms_fp32(x: np.ndarray, eps: float) -> np.ndarray:
    ms = np.float32((x.astype(np.float64) ** 2).sum(-1, keepdims=True) / x.shape[-1])
    return np.float32(1) / np.sqrt(ms + np.float32(eps))


def rotate(v: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    a, b = v[..., 0::2], v[..., 1::2]
    out = np.empty_like(v)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def assert_within(got, want, tol, what):
    bad = np.abs(got - want) > tol
    assert not bad.any(), (f"{what}: {bad.sum()} values off, e.g. got {got[bad][:3]} want "
                           f"{want[bad][:3]} tol {tol[bad][:3]}")


@pytest.mark.parametrize("dialect", ["fnuz", "ocp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_rope_store_numerics(backend, dialect):
    kernel = use_backend(backend, dialect)
    page_size, n = 64, 16
    args = clone_args(norm_rope_args(11, n, page_size, 3, heads=2))
    q_in = args["q"].float().numpy()
    on_dev = to_device(args, DEV)
    hip_kernels.fused_k_norm_rope_store(**on_dev, kernel=kernel)
    args = to_device(on_dev, "cpu")

    keep = args["out_loc"] >= 0
    loc = args["out_loc"][keep]
    x = args["kv"].float().numpy()[keep.numpy()]
    f = args["freqs_cis"][args["positions"].long()]
    cos, sin = f.real.numpy(), f.imag.numpy()
    y = args["weight"].float().numpy() * (x * rms_fp32(x, args["eps"]))

    d = kernel.fp8_dialect
    got = hip_kernels.read_kv_rows(args["cache"], loc, page_size, d).numpy()
    _, scale_bytes = L.read_kv_bytes(args["cache"], loc, page_size)
    scale = 2.0 ** (scale_bytes[:, :L.N_TILES].numpy().astype(np.int32) - L.UE8M0_BIAS)
    scale = np.repeat(scale, L.TILE, axis=1)
    nope, got_nope = y[:, :L.NOPE_DIM], got[:, :L.NOPE_DIM]
    step = fp8_step(np.maximum(np.abs(nope), np.abs(got_nope)) / scale, d.name) * scale
    assert_within(got_nope, nope, step, "nope")

    amax = np.maximum(np.abs(bf16(nope)).reshape(-1, L.N_TILES, L.TILE).max(-1), L.AMAX_FLOOR)
    tile_scale = scale[:, ::L.TILE]
    assert (amax / tile_scale <= d.max).all() and (amax / (tile_scale / 2) > d.max).all()

    rope = rotate(bf16(y[:, L.NOPE_DIM:]), cos[keep.numpy()], sin[keep.numpy()])
    assert_within(got[:, L.NOPE_DIM:], rope, ulp_bf16(rope), "rope")

    yq = q_in * rms_fp32(q_in, args["eps"])
    got_q = args["q"].float().numpy()
    assert_within(got_q[..., :L.NOPE_DIM], yq[..., :L.NOPE_DIM], ulp_bf16(yq[..., :L.NOPE_DIM]),
                  "q nope")
    q_rope = rotate(bf16(yq[..., L.NOPE_DIM:]), cos[:, None], sin[:, None])
    assert_within(got_q[..., L.NOPE_DIM:], q_rope, ulp_bf16(q_rope), "q rope")


@pytest.mark.parametrize("dialect", ["fnuz", "ocp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_store_numerics(backend, dialect):
    kernel = use_backend(backend, dialect)
    page_size, n = 64, 12
    k = bf16_rows(gen(4), n, L.INDEX_DIM)
    cache = indexer_cache(2, page_size)
    loc = torch.randperm(2 * page_size, generator=gen(5))[:n]
    on_dev = to_device(dict(k=k, cache=cache, out_loc=loc, page_size=page_size), DEV)
    hip_kernels.indexer_store(**on_dev, kernel=kernel)
    cache = on_dev["cache"].cpu()
    d = kernel.fp8_dialect
    got = hip_kernels.read_indexer_rows(cache, loc, page_size, d).numpy()
    kf = k.float().numpy()
    scale = np.maximum(np.abs(kf).max(-1, keepdims=True), L.AMAX_FLOOR) / d.max
    step = fp8_step(np.maximum(np.abs(kf), np.abs(got)) / scale, d.name) * scale
    assert_within(got, kf, step * (1 + 2 ** -20), "indexer")
