"""The HIP C++ set-KV kernel's logic, run on the CPU, writes exactly the torch reference's bytes.

tests/csrc/set_kv_host_harness.cpp compiles the kernel's argument code and per-lane phases
(hip_kernels/csrc) as host C++ and replaces the wavefront shuffles by loops, so everything but
the shuffles and the gfx942 hardware fp8 convert is checked here without a GPU: both fp8
dialects, both row splits (64 lanes as on AMD, 32 as on NVIDIA), page sizes, int32/int64
locations, strided rows, q heads, translation, offsets past 4 GiB and the argument checks.
"""

import mmap
from pathlib import Path

import pytest
import torch

from hip_kernels import kv_layout as L
from hip_kernels import set_kv_ref as R
from hip_kernels.platform import FNUZ, OCP
from kv_inputs import clone_args, same_bytes
from set_kv_cases import (OPS, SHAPES, every_bf16_case, make_case, nonfinite_case, outputs,
                          reference)

ROOT = Path(__file__).resolve().parent.parent
TWO_32 = 2 ** 32


@pytest.fixture(scope="module")
def host_ops(tmp_path_factory):
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        pytest.skip("ninja is not installed: torch builds C++ extensions with it")
    try:
        cpp_extension.load(
            name="dsv4_set_kv_host", sources=[str(ROOT / "tests/csrc/set_kv_host_harness.cpp")],
            extra_include_paths=[str(ROOT / "hip_kernels/csrc")],
            extra_cflags=["-O1", "-ffp-contract=off"],
            build_directory=str(tmp_path_factory.mktemp("set_kv_host")), is_python_module=False)
    except (OSError, RuntimeError) as e:
        if cpp_extension.get_cxx_compiler() and "error:" in str(e):
            raise
        pytest.skip(f"no working C++ compiler: {e}")
    return torch.ops.dsv4_set_kv_host


def run_host(host_ops, op: str, args: dict, dialect, lanes: int) -> dict:
    a = clone_args(args)
    fnuz = dialect.name == "fnuz"
    if op == "fused_store_cache":
        host_ops.store_cache(a["rows"], a["cache"], a["out_loc"], a["page_size"], fnuz, lanes)
        return outputs(a)
    freqs = torch.view_as_real(a["freqs_cis"])
    common = (a["kv"], a["weight"], a["eps"], freqs, a["positions"])
    if op == "fused_k_norm_rope_store":
        host_ops.k_norm_rope_store(*common, a["out_loc"], a["cache"], a["page_size"], a.get("q"),
                                   fnuz, lanes)
    else:
        host_ops.translate_norm_rope_store(*common, a["full_loc"], a["full_to_swa"], a["cache"],
                                           a["page_size"], a.get("swa_loc_out"), fnuz, lanes)
    return outputs(a)


def run_host_in_place(host_ops, op: str, a: dict) -> dict:
    """run_host on `a` itself (fnuz, 64 lanes), so a write past a view's end stays visible."""
    freqs = torch.view_as_real(a["freqs_cis"]) if "freqs_cis" in a else None
    if op == "fused_store_cache":
        host_ops.store_cache(a["rows"], a["cache"], a["out_loc"], a["page_size"], True, 64)
    elif op == "fused_k_norm_rope_store":
        host_ops.k_norm_rope_store(a["kv"], a["weight"], a["eps"], freqs, a["positions"],
                                   a["out_loc"], a["cache"], a["page_size"], a.get("q"), True, 64)
    else:
        host_ops.translate_norm_rope_store(a["kv"], a["weight"], a["eps"], freqs, a["positions"],
                                           a["full_loc"], a["full_to_swa"], a["cache"],
                                           a["page_size"], a.get("swa_loc_out"), True, 64)
    return outputs(a)


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert same_bytes(got[k], want[k]), f"{k} differs"


@pytest.mark.parametrize("lanes", [64, 32])
@pytest.mark.parametrize("dialect", [FNUZ, OCP], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_bytes_match_the_reference(host_ops, op, shape, dialect, lanes):
    args = make_case(op, shape, *SHAPES[shape])
    want = reference(op, args, dialect)
    assert_same(run_host(host_ops, op, args, dialect, lanes), want)
    assert not same_bytes(want["cache"], args["cache"]), "the case wrote nothing"


@pytest.mark.parametrize("dialect", [FNUZ, OCP], ids=str)
def test_every_bf16_value_quantizes_like_torch(host_ops, dialect):
    args, tiles = every_bf16_case(dialect)
    want = reference("fused_store_cache", args, dialect)
    assert_same(run_host(host_ops, "fused_store_cache", args, dialect, 64), want)
    scales = want["cache"][:, L.VALUE_BYTES:L.VALUE_BYTES + L.N_TILES].flatten()[:tiles]
    assert (scales == L.UE8M0_BIAS).all()  # every tile's scale is 2^0


def test_only_the_written_rows_change(host_ops):
    args = make_case("fused_translate_norm_rope_store", 7, 16, 4, 8, 0, torch.int64,
                     torch.bfloat16)
    got = run_host(host_ops, "fused_translate_norm_rope_store", args, FNUZ, 64)
    swa = got["swa_loc_out"]
    written = swa[swa > 0]
    assert (swa == -1).any() and (swa == 0).any() and len(written) > 4
    mask = torch.zeros_like(args["cache"], dtype=torch.bool).view(-1)
    for off, width in ((L.value_offset(written, 4), L.VALUE_BYTES),
                       (L.scale_offset(written, 4), L.SCALE_BYTES)):
        mask[(off.unsqueeze(1) + torch.arange(width)).flatten()] = True
    changed = (got["cache"] != args["cache"]).view(-1)
    assert not (changed & ~mask).any()


def test_rows_past_4gib(host_ops):
    page_size = 256
    page_bytes = L.page_bytes(page_size)
    pages = TWO_32 // page_bytes + 2
    try:
        buffers = [mmap.mmap(-1, pages * page_bytes) for _ in range(2)]
    except (OSError, ValueError, OverflowError) as e:
        pytest.skip(f"cannot map 2 x {pages * page_bytes} bytes of virtual memory: {e}")
    caches = [torch.frombuffer(b, dtype=torch.uint8).view(pages, page_bytes) for b in buffers]
    loc = torch.tensor([(2 ** 31 // page_bytes + 1) * page_size + 7, pages * page_size - 1, 3, -1],
                       dtype=torch.int32)
    args = make_case("fused_k_norm_rope_store", 3, len(loc), page_size, 1, 0, torch.int32,
                     torch.bfloat16)
    args.update(out_loc=loc, cache=caches[0])
    R.fused_k_norm_rope_store(**args, q=None, dialect=OCP)
    host_ops.k_norm_rope_store(args["kv"], args["weight"], args["eps"],
                               torch.view_as_real(args["freqs_cis"]), args["positions"], loc,
                               caches[1], page_size, None, False, 64)
    for page in sorted({int(x) // page_size for x in loc if x >= 0}):
        assert same_bytes(caches[0][page], caches[1][page]), f"page {page} differs"
        assert caches[1][page].count_nonzero() > 0
    assert int(loc.max()) // page_size * page_bytes > TWO_32


def test_argument_checks(host_ops):
    args = make_case("fused_k_norm_rope_store", 1, 4, 2, 4, 1, torch.int64, torch.bfloat16)
    freqs = torch.view_as_real(args["freqs_cis"])

    def call(**over):
        a = {**args, **over}
        host_ops.k_norm_rope_store(a["kv"], a["weight"], a["eps"], a.get("freqs", freqs),
                                   a["positions"], a["out_loc"], a["cache"], a["page_size"],
                                   a.get("q"), True, 64)

    with pytest.raises(RuntimeError, match="page stride"):
        call(page_size=4)
    with pytest.raises(RuntimeError, match="kv must have unit inner stride"):
        call(kv=torch.zeros(4, 1024, dtype=torch.bfloat16)[:, ::2])
    with pytest.raises(RuntimeError, match="weight must be bfloat16 or float32"):
        call(weight=args["weight"].half())
    with pytest.raises(RuntimeError, match="out_loc must be int32 or int64"):
        call(out_loc=args["out_loc"].float())
    with pytest.raises(RuntimeError, match="q must be bfloat16"):
        call(q=args["q"].float())
    with pytest.raises(RuntimeError, match="freqs must be view_as_real"):
        call(freqs=freqs.transpose(0, 1))


@pytest.mark.parametrize("op", OPS)
def test_slots_past_the_cache_are_masked_in_the_kernel(host_ops, flag_env, op):
    """With the host's range checks off (DSV4_KERNEL_VALUE_CHECKS=0, or inside graph capture), a
    slot past the cache, or a full location past the map, writes nothing: the HIP kernel's logic
    and the torch reference mask it alike, and in-range rows still land."""
    flag_env(DSV4_KERNEL_VALUE_CHECKS="0")
    args = make_case(op, 3, 6, 4, 2, 0, torch.int64, torch.bfloat16)
    # the cache is the first 2 of 3 pages: an unmasked write to slot 8 would land in the third
    base = torch.full((3, L.page_bytes(4)), 0x5A, dtype=torch.uint8)
    args["cache"] = base[:2]   # 2 pages of 4 slots
    if op == "fused_translate_norm_rope_store":
        args["full_to_swa"][args["full_loc"][0]] = 8          # maps to the slot past the cache
        args["full_loc"][1] = len(args["full_to_swa"]) + 5    # past the map
    else:
        args["out_loc"][0], args["out_loc"][1] = 8, 1 << 40
    want = reference(op, args, FNUZ)
    a = dict(clone_args(args), cache=base[:2])  # run on the view itself, not a copy
    fnuz_args = run_host_in_place(host_ops, op, a)
    assert (base[2] == 0x5A).all(), "the kernel wrote past the cache"
    assert_same(fnuz_args, want)
    assert not (want["cache"] == 0x5A).all(), "the in-range rows were not written"
    if op == "fused_translate_norm_rope_store":
        assert want["swa_loc_out"][:2].tolist() == [8, -1]


@pytest.mark.parametrize("lanes", [64, 32])
@pytest.mark.parametrize("dialect", [FNUZ, OCP], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_nonfinite_rows_are_poisoned_like_the_reference(host_ops, op, dialect, lanes):
    """NaN and inf in K/V: the HIP logic writes the reference's poisoned bytes (the policy itself
    is checked in test_set_kv_nonfinite.py)."""
    args, _ = nonfinite_case(op, 4)
    want = reference(op, args, dialect)
    assert (want["cache"] == 0xFF).any()
    assert_same(run_host(host_ops, op, args, dialect, lanes), want)
