"""The V4 paged FP8 KV layout, checked by hand for every backend that can run here: page strides,
where a row's bytes land, read-back, and argument errors raised before any byte is written."""

import importlib.util

import pytest
import torch

import hip_kernels
from hip_kernels import KernelOptions
from hip_kernels import kv_layout as L
from hip_kernels.platform import DIALECTS, FNUZ, OCP, default_device
from kv_inputs import (SENTINEL, bf16_rows, clone_args, gen, indexer_cache, kv_cache,
                       norm_rope_args, to_device)

DEV = default_device()

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
if "triton" in BACKENDS:
    from triton_interp_shim import interpreter_shim  # noqa: F401 (autouse fixture)


def test_page_bytes_by_hand():
    # ceil(P * 584 / 576) * 576, worked out by hand
    assert {p: L.page_bytes(p) for p in (1, 2, 64, 128, 256)} == {
        1: 1152, 2: 1728, 64: 37440, 128: 74880, 256: 149760}
    for p in range(1, 300):
        pb = L.page_bytes(p)
        assert pb % 576 == 0 and p * 584 <= pb < p * 584 + 576
    assert L.indexer_page_bytes(64) == 64 * 132
    with pytest.raises(ValueError, match="page_size"):
        L.page_bytes(0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size,page,t", [(1, 2, 0), (2, 1, 1), (64, 1, 37)])
def test_hand_built_row_lands_in_place(backend, page_size, page, t):
    kernel = KernelOptions(backend=backend, fp8_dialect=OCP)
    nope_bytes = (torch.arange(L.NOPE_DIM) % 251).to(torch.uint8)      # fp8 values 0x00..0xFA
    rope = torch.arange(L.ROPE_DIM, dtype=torch.float32).to(torch.bfloat16)
    rope[0] = 1.0                                                      # bf16 0x3F80
    scales = torch.arange(120, 127, dtype=torch.uint8)
    args = to_device(dict(nope_fp8=nope_bytes.view(torch.float8_e4m3fn)[None], rope_bf16=rope[None],
                          scales=scales[None], cache=kv_cache(3, page_size),
                          out_loc=torch.tensor([page * page_size + t]), page_size=page_size), DEV)
    hip_kernels.store_kv_pack(**args, kernel=kernel)
    cache = args["cache"].cpu()

    row = cache[page]
    value = row[t * 576:(t + 1) * 576]
    assert torch.equal(value[:448], nope_bytes)
    assert value[448:450].tolist() == [0x80, 0x3F]                     # little-endian bf16 1.0
    assert torch.equal(value[448:], rope.view(torch.uint8))
    scale_at = page_size * 576 + t * 8
    assert row[scale_at:scale_at + 7].tolist() == list(range(120, 127))
    assert row[scale_at + 7] == 0                                      # pad byte
    untouched = torch.ones(cache.numel(), dtype=torch.bool)
    base = page * L.page_bytes(page_size)
    untouched[base + t * 576:base + (t + 1) * 576] = False
    untouched[base + scale_at:base + scale_at + 8] = False
    assert bool((cache.view(-1)[untouched] == SENTINEL).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dialect", ["fnuz", "ocp"])
def test_read_kv_rows_round_trip(backend, dialect):
    d = DIALECTS[dialect]
    kernel = KernelOptions(backend=backend, fp8_dialect=d)
    rows = bf16_rows(gen(2), 6, L.HEAD_DIM).to(DEV)
    loc = torch.tensor([5, 0, 63, 64, 100, 127], device=DEV)
    cache = kv_cache(2, 64).to(DEV)
    hip_kernels.fused_store_cache(rows, cache, loc, 64, kernel=kernel)
    got = hip_kernels.read_kv_rows(cache, loc, 64, d)
    assert torch.equal(got, hip_kernels.dequantize_kv_rows(*hip_kernels.quantize_kv_rows(rows, d)))
    assert torch.equal(got[:, L.NOPE_DIM:], rows[:, L.NOPE_DIM:].float())

    k = bf16_rows(gen(3), 6, L.INDEX_DIM).to(DEV)
    icache = indexer_cache(2, 64).to(DEV)
    hip_kernels.indexer_store(k, icache, loc, 64, kernel=kernel)
    q, scale = L.quantize_indexer_rows(k, d)
    got_k = hip_kernels.read_indexer_rows(icache, loc, 64, d)
    assert torch.equal(got_k, q.float() * scale[:, None])


def _bad(**changes):
    """A fused_k_norm_rope_store case with some arguments replaced (callables get the args)."""
    def make():
        args = clone_args(norm_rope_args(9, 4, 64, 2, heads=2))
        for k, v in changes.items():
            args[k] = v(args) if callable(v) else v
        return args
    return make


BAD_NORM_ROPE = {
    "kv dtype": (_bad(kv=lambda a: a["kv"].float()), TypeError, "kv must have dtype"),
    "kv shape": (_bad(kv=lambda a: a["kv"][:, :511]), ValueError, "kv must have shape"),
    "kv inner stride": (_bad(kv=lambda a: torch.zeros(4, 1024, dtype=torch.bfloat16)[:, ::2]),
                        ValueError, "kv must have unit stride"),
    "weight shape": (_bad(weight=torch.ones(448)), ValueError, "weight must have shape"),
    "weight stride": (_bad(weight=torch.ones(1024)[::2]), ValueError, "weight must have unit"),
    "freqs dtype": (_bad(freqs_cis=lambda a: a["freqs_cis"].real), TypeError, "freqs_cis"),
    "positions length": (_bad(positions=torch.zeros(3, dtype=torch.int64)), ValueError,
                         "positions must have shape"),
    "positions range": (_bad(positions=torch.tensor([0, 1, 97, 2])), IndexError,
                        "positions holds 97"),
    "negative position": (_bad(positions=torch.tensor([0, -1, 2, 3])), IndexError,
                          "positions holds -1"),
    "out_loc dtype": (_bad(out_loc=torch.zeros(4)), TypeError, "out_loc must have dtype"),
    "out_loc range": (_bad(out_loc=torch.tensor([0, 1, 128, -1])), IndexError,
                      "out_loc holds location 128"),
    "page-size mismatch": (_bad(page_size=128), ValueError, "page-size mismatch"),
    "cache dtype": (_bad(cache=lambda a: a["cache"].view(torch.int8)), TypeError, "cache"),
    "q shape": (_bad(q=lambda a: a["q"][:, :, :256]), ValueError, "q must have shape"),
    "q rows": (_bad(q=lambda a: a["q"][:3]), ValueError, "q must have shape"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD_NORM_ROPE.keys())
def test_bad_input_raises_before_writing(flag_env, backend, case):
    kernel = KernelOptions(backend=backend)
    make, exc, message = BAD_NORM_ROPE[case]
    args = make()
    cache_before, q_before = args["cache"].clone(), args["q"].clone()
    with pytest.raises(exc, match=message):
        hip_kernels.fused_k_norm_rope_store(**args, kernel=kernel)
    assert torch.equal(args["cache"].view(torch.uint8), cache_before.view(torch.uint8))
    assert torch.equal(args["q"], q_before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_of_the_other_ops(backend):
    kernel = KernelOptions(backend=backend, fp8_dialect=FNUZ)
    cache, icache = kv_cache(2, 64), indexer_cache(2, 64)
    rows, loc = bf16_rows(gen(1), 3, L.HEAD_DIM), torch.tensor([0, 5, -1])
    nope, rope, scales = L.quantize_kv_rows(rows, FNUZ)
    args = norm_rope_args(1, 3, 64, 2)
    f2s = torch.tensor([0, 7, 200, 3])
    cases = [
        (lambda: hip_kernels.fused_store_cache(rows, cache, torch.tensor([0, 128, 1]), 64,
                                               kernel=kernel), IndexError, "out_loc"),
        (lambda: hip_kernels.store_kv_pack(nope.view(torch.uint8).view(torch.float8_e4m3fn), rope,
                                           scales, cache, loc, 64, kernel=kernel),
         TypeError, "nope_fp8"),
        (lambda: hip_kernels.store_kv_pack(nope, rope, scales[:, :6], cache, loc, 64,
                                           kernel=kernel), ValueError, "scales"),
        (lambda: hip_kernels.indexer_store(rows[:, :64].contiguous(), icache, loc, 64,
                                           kernel=kernel), ValueError, "k must have shape"),
        (lambda: hip_kernels.indexer_store(rows[:, :128].contiguous(), cache, loc, 64,
                                           kernel=kernel), ValueError, "page-size mismatch"),
        (lambda: hip_kernels.fused_translate_norm_rope_store(
            args["kv"], args["weight"], 1e-6, args["freqs_cis"], args["positions"],
            torch.tensor([1, 2, -1]), f2s, cache, 64, kernel=kernel), IndexError, "SWA slot 200"),
        (lambda: hip_kernels.fused_translate_norm_rope_store(
            args["kv"], args["weight"], 1e-6, args["freqs_cis"], args["positions"],
            torch.tensor([1, 4, -1]), f2s, cache, 64, kernel=kernel), IndexError, "full_loc"),
        (lambda: hip_kernels.fused_translate_norm_rope_store(
            args["kv"], args["weight"], 1e-6, args["freqs_cis"], args["positions"],
            torch.tensor([1, 3, -1]), f2s, cache, 64, torch.zeros(3, dtype=torch.int64),
            kernel=kernel),
         TypeError, "swa_loc_out"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()
    assert bool((cache == SENTINEL).all()) and bool((icache == SENTINEL).all())


def test_reads_through_a_strided_view_see_each_page_where_it_lies():
    """A cache handed over as a view with pages further apart than page_bytes (a host engine's
    slice of a bigger buffer) reads back the bytes of the same pages stored contiguously, both
    as raw bytes and as dequantized rows."""
    p, pages, gap = 4, 3, 40
    used = L.page_bytes(p)
    buffer = torch.randint(0, 120, (pages, used + gap), generator=gen(3), dtype=torch.uint8)
    strided = buffer[:, :used]
    assert not strided.is_contiguous()
    contiguous = strided.contiguous()
    loc = torch.tensor([0, 3, 4, 6, 11, 9])
    for got, want in zip(L.read_kv_bytes(strided, loc, p), L.read_kv_bytes(contiguous, loc, p)):
        assert torch.equal(got, want)
    assert torch.equal(L.read_kv_rows(strided, loc, p, OCP),
                       L.read_kv_rows(contiguous, loc, p, OCP))
    # the page a location names, not its neighbour: rows of page 2 are the last page's bytes
    values, scales = L.read_kv_bytes(strided, torch.tensor([8]), p)
    assert torch.equal(values[0], buffer[2, :L.VALUE_BYTES])
    assert torch.equal(scales[0], buffer[2, p * L.VALUE_BYTES:p * L.VALUE_BYTES + L.SCALE_BYTES])
