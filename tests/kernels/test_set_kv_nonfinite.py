"""NaN and inf in K/V: stored poisoned, the same bytes in every backend, or refused on request.

The policy (hip_kernels.kv_layout): a 64-wide nope tile holding a NaN or inf is stored as the
dialect's NaN byte 64 times with scale byte 0xFF; a NaN RoPE value as the bf16 NaN 0x7FC0;
an indexer key holding one as NaN bytes with a NaN fp32 scale. Here the torch reference is held
to the policy stated independently, and Triton (the interpreter on a CPU) to the reference byte
for byte; the HIP C++ logic is held to it in test_set_kv_host_harness.py. The reported case
(issue 27) is held across all three, Triton under the interpreter as Triton ships it.
"""

import pytest
import torch

import hip_kernels
from hip_kernels import KernelOptions
from hip_kernels import kv_layout as L
from hip_kernels import set_kv_ref as R
from hip_kernels.platform import DIALECTS, FNUZ, OCP, default_device
from kv_inputs import clone_args, gen, indexer_cache, same_bytes, to_device
from set_kv_cases import NONFINITE, OPS, nonfinite_case, reference
from set_kv_host import build_host_ops
from triton_interp_shim import interpreter_shim, unshimmed  # noqa: F401 (autouse fixture)

DEV = default_device()
P = 4


def stored(cache, slots):
    values, scales = L.read_kv_bytes(cache, slots, P)
    return values, scales[:, :L.N_TILES]


@pytest.mark.parametrize("dialect", [FNUZ, OCP], ids=str)
def test_store_cache_poisons_exactly_the_tiles_holding_a_nonfinite_value(dialect):
    args, slots = nonfinite_case("fused_store_cache", P)
    out = reference("fused_store_cache", args, dialect)["cache"]
    values, scales = stored(out, slots)
    clean = clone_args(args)                              # the same rows with zeros instead
    for row, dim, _ in NONFINITE:
        clean["rows"][row, dim] = 0
    clean_values, clean_scales = stored(reference("fused_store_cache", clean, dialect)["cache"],
                                        slots)
    poisoned = {(row, dim // L.TILE) for row, dim, _ in NONFINITE if dim < L.NOPE_DIM}
    assert poisoned == {(0, 1), (1, 0)}
    for row in range(6):
        for t in range(L.N_TILES):
            tile = values[row, t * L.TILE:(t + 1) * L.TILE]
            if (row, t) in poisoned:
                assert (tile == dialect.nan_byte).all() and scales[row, t] == 0xFF
            else:
                assert same_bytes(tile, clean_values[row, t * L.TILE:(t + 1) * L.TILE])
                assert scales[row, t] == clean_scales[row, t]
    rope = values[:, L.NOPE_DIM:].contiguous().view(torch.int16).view(6, L.ROPE_DIM)
    clean_rope = clean_values[:, L.NOPE_DIM:].contiguous().view(torch.int16).view(6, L.ROPE_DIM)
    assert rope[1, 470 - L.NOPE_DIM] == 0x7FC0                 # -NaN with a payload: canonical
    assert rope[2, 500 - L.NOPE_DIM] == 0x7F80                 # +inf stays +inf
    rope[1, 470 - L.NOPE_DIM] = rope[2, 500 - L.NOPE_DIM] = 0
    assert torch.equal(rope, clean_rope)


@pytest.mark.parametrize("dialect", [FNUZ, OCP], ids=str)
def test_normed_rows_with_a_nan_or_inf_are_poisoned_as_the_arithmetic_says(dialect):
    """A NaN makes the RMS of its row NaN, so every tile and every RoPE value of rows 0 and 1 is
    NaN. Row 2's inf (RoPE dim 500) makes the mean square infinite and 1/RMS zero: every other
    value becomes 0 (zero tiles: the amax floor's scale), dim 500 is inf * 0 = NaN and the
    rotation spreads it to its pair (dims 500 and 501)."""
    args, slots = nonfinite_case("fused_k_norm_rope_store", P)
    values, scales = stored(reference("fused_k_norm_rope_store", args, dialect)["cache"], slots)
    rope = values[:, L.NOPE_DIM:].contiguous().view(torch.int16).view(6, L.ROPE_DIM)
    for row in (0, 1):
        assert (values[row, :L.NOPE_DIM] == dialect.nan_byte).all()
        assert (scales[row] == 0xFF).all() and (rope[row] == 0x7FC0).all()
    zero_tile_scale = int(L.pow2_ceil_exponent(torch.tensor(L.AMAX_FLOOR / dialect.max))) + 127
    assert (scales[2] == zero_tile_scale).all()
    assert (values[2, :L.NOPE_DIM].view(dialect.torch_dtype).float() == 0).all()
    nan_pair = torch.zeros(L.ROPE_DIM, dtype=torch.bool)
    nan_pair[500 - L.NOPE_DIM:502 - L.NOPE_DIM] = True
    assert (rope[2][nan_pair] == 0x7FC0).all()
    assert (rope[2][~nan_pair].view(torch.bfloat16).float() == 0).all()
    assert (scales[3:] != 0xFF).all()                              # finite rows are not touched


def reported_case():
    """Issue 27's rows: a NaN in row 0's tile 0, +inf among row 1's RoPE dims."""
    rows = torch.randn(2, 512, generator=gen(0)).to(torch.bfloat16)
    rows[0, 3], rows[1, 500] = float("nan"), float("inf")
    return dict(rows=rows, cache=torch.zeros(4, L.page_bytes(4), dtype=torch.uint8),
                out_loc=torch.tensor([1, 6]), page_size=4)


@pytest.mark.parametrize("dialect", ["fnuz", "ocp"])
def test_the_reported_case_poisons_one_tile_and_changes_no_other(dialect):
    d = DIALECTS[dialect]
    args = reported_case()
    values, scales = stored(reference("fused_store_cache", args, d)["cache"], args["out_loc"])
    clean = clone_args(args)
    clean["rows"][0, 3] = clean["rows"][1, 500] = 0
    clean_values, clean_scales = stored(reference("fused_store_cache", clean, d)["cache"],
                                        args["out_loc"])
    assert (values[0, :L.TILE] == d.nan_byte).all() and scales[0, 0] == 0xFF
    assert same_bytes(values[0, L.TILE:], clean_values[0, L.TILE:])
    assert torch.equal(scales[0, 1:], clean_scales[0, 1:])
    assert same_bytes(values[1, :L.NOPE_DIM], clean_values[1, :L.NOPE_DIM])
    assert torch.equal(scales[1], clean_scales[1])
    assert values[1, 2 * 500 - L.NOPE_DIM:][:2].view(torch.int16) == 0x7F80     # +inf


@pytest.mark.parametrize("dialect", ["fnuz", "ocp"])
@pytest.mark.parametrize("backend", ["triton", "hip_host"])
def test_the_reported_case_stores_the_reference_bytes(tmp_path_factory, backend, dialect):
    """Triton's interpreter rounded fp32 -> fp8 its own way (57 bytes of clean tiles differed);
    the kernel now rounds on the CPU in integer arithmetic, so no shim is needed."""
    args = reported_case()
    want = reference("fused_store_cache", args, DIALECTS[dialect])["cache"]
    if backend == "hip_host":
        host = build_host_ops(tmp_path_factory)
        a = clone_args(args)
        host.store_cache(a["rows"], a["cache"], a["out_loc"], 4, dialect == "fnuz", 64)
        got = a["cache"]
    else:
        pytest.importorskip("triton")
        with unshimmed():
            got = run("triton", dialect, "fused_store_cache", args)["cache"]
    assert same_bytes(got, want)


def run(backend, dialect, op, args):
    a = to_device(clone_args(args), DEV)
    getattr(hip_kernels, op)(**a, kernel=KernelOptions(backend=backend,
                                                       fp8_dialect=DIALECTS[dialect]))
    return to_device(a, "cpu")


@pytest.mark.parametrize("dialect", ["fnuz", "ocp"])
@pytest.mark.parametrize("op", OPS)
def test_triton_stores_the_reference_bytes(op, dialect):
    pytest.importorskip("triton")
    args, _ = nonfinite_case(op, P)
    want = reference(op, args, DIALECTS[dialect])
    got = run("triton", dialect, op, args)
    for k in want:
        assert same_bytes(got[k], want[k]), k


def indexer_case():
    g = gen(5)
    k = torch.randn(5, L.INDEX_DIM, generator=g).to(torch.bfloat16)
    k[0, 3], k[1, 100], k[2, 7] = float("nan"), float("-inf"), NEG_ZERO_NAN
    return dict(k=k, cache=indexer_cache(4, P), out_loc=torch.tensor([5, 0, 9, 14, 2]),
                page_size=P)


NEG_ZERO_NAN = torch.tensor([0xFF81], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[0]


@pytest.mark.parametrize("dialect", ["fnuz", "ocp"])
def test_indexer_keys_with_a_nonfinite_value_are_poisoned(dialect):
    d = DIALECTS[dialect]
    args = indexer_case()
    ref = clone_args(args)
    R.indexer_store(**ref, dialect=d.name, pow2_scale=False, key_tile=0)
    for row, loc in enumerate(args["out_loc"].tolist()):
        page = ref["cache"][loc // P]
        vals = page[loc % P * L.INDEX_DIM:][:L.INDEX_DIM]
        scale = page[P * L.INDEX_DIM + loc % P * 4:][:4].view(torch.int32)
        assert bool((vals == d.nan_byte).all() and scale == L.FP32_NAN) == (row < 3)
    pytest.importorskip("triton")
    got = run("triton", dialect, "indexer_store", args)
    assert same_bytes(got["cache"], ref["cache"])


@pytest.mark.parametrize("op", OPS + ("indexer_store",))
def test_the_refuse_option_raises_before_a_byte_is_written(op):
    refuse = KernelOptions(refuse_nonfinite=True)
    args = indexer_case() if op == "indexer_store" else nonfinite_case(op, P)[0]
    before = args["cache"].clone()
    name = {"fused_store_cache": "rows", "indexer_store": "k"}.get(op, "kv")
    with pytest.raises(ValueError, match=fr"^{name} row 0 holds a NaN or inf"):
        getattr(hip_kernels, op)(**args, kernel=refuse)
    assert torch.equal(args["cache"], before)
    src = args[name]
    for row in range(3):
        src[row] = 0                                             # finite again: stored
    getattr(hip_kernels, op)(**args, kernel=refuse)
    assert not torch.equal(args["cache"], before)
