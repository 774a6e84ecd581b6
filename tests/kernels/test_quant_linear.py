"""DeepSeek-V4's quantized linears (`hip_kernels.quant_linear`): the torch references against a
float64 restatement of the reference kernels' formulas, `ocp_to_fnuz` on all 256 bytes, fnuz
activations that dequantize to the reference's values, the Triton kernels (under the
interpreter, with the conversion shim) byte for byte against the torch references, one
dispatcher op per call, Meta shapes, and argument errors.

The Triton kernels' interpreter mode sums each block's exact products in float64 and rounds once
to fp32, as the references do, so the bf16 outputs are byte-equal. On a GPU the matrix cores sum
in their own fp32 order: test_quant_linear_nvidia.py holds that bound and the sm_90 compile.
"""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import (KernelOptions, act_quant, fp4_grouped_linear,  # noqa: E402
                         fp8_grouped_linear, fp8_linear, ocp_to_fnuz)
from hip_kernels import quant_linear_ref as R  # noqa: E402
from hip_kernels import quant_linear_triton as T  # noqa: E402
from hip_kernels.capture import set_emulated_capture  # noqa: E402
from hip_kernels.library import op  # noqa: E402
from hip_kernels.platform import FNUZ, OCP  # noqa: E402
from launch_recorder import LaunchRecorder  # noqa: E402
from op_recorder import op_names, recorded_ops  # noqa: E402
from quant_inputs import e8m0, fp4_weight, fp8_weight, gen, rows  # noqa: E402
from triton_interp_shim import interpreter_shim  # noqa: E402,F401 (autouse fixture)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TORCH = KernelOptions(backend="torch")
TRITON = KernelOptions(backend="triton")


# ---- the references against the formula, in float64 -------------------------------------------

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
FINITE = ~torch.isnan(E4M3_VALUES)


def nearest_e4m3(y):
    """Round float64 y (|y| <= 448) to the nearest e4m3fn value, ties to an even code."""
    values, codes = E4M3_VALUES[FINITE], torch.arange(256)[FINITE]
    dist = (y.reshape(-1, 1) - values).abs()
    best = dist.min(-1, keepdim=True).values
    tie_ok = (dist == best) & ((codes % 2 == 0) | ((dist == best).sum(-1, keepdim=True) == 1))
    return values[tie_ok.float().argmax(-1)].reshape(y.shape)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_act_quant_is_the_formula(scale_fmt):
    x = rows(gen(1), 6, 384)
    q, s = act_quant(x, scale_fmt)
    amax = x.double().unflatten(-1, (-1, 128)).abs().amax(-1).clamp_min(float(torch.tensor(1e-4)))
    if scale_fmt:
        want_s = torch.pow(2.0, torch.ceil(torch.log2(amax / 448)))
    else:   # amax times fp32(1/448), rounded once to fp32
        want_s = (amax * float(torch.tensor(1 / 448, dtype=torch.float32))).float().double()
    assert torch.equal(s.double(), want_s)
    y = (x.double().unflatten(-1, (-1, 128)) / want_s[..., None]).clamp(-448, 448).flatten(-2)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.double(), nearest_e4m3(y))
    assert q.double().abs().max() <= 448


def test_fp8_gemm_ref_is_exact_on_powers_of_two():
    """Small integer fp8 values and power-of-two scales keep every fp32 step exact, so the
    reference equals the float64 formula rounded once to bf16; random scales stay within fp32
    rounding of it."""
    g = gen(2)
    qa = torch.randint(-8, 9, (5, 256), generator=g).float().to(torch.float8_e4m3fn)
    qb = torch.randint(-8, 9, (130, 256), generator=g).float().to(torch.float8_e4m3fn)
    sa = torch.pow(2.0, torch.randint(-4, 4, (5, 2), generator=g).float())
    sb = e8m0(g, 2, 2)
    sb64 = R.e8m0_to_float(sb).double().repeat_interleave(128, 0)[:130]
    want = sum((qa.double()[:, c:c + 128] @ qb.double()[:, c:c + 128].T)
               * sa.double()[:, c // 128, None] * sb64[None, :, c // 128] for c in (0, 128))
    assert torch.equal(R.fp8_gemm_ref(qa, sa, qb, sb), want.to(torch.bfloat16))
    sa = torch.rand(5, 2, generator=g) + 0.5
    got = R.fp8_gemm_ref(qa, sa, qb, sb.float() * 1.37).double()
    want = sum((qa.double()[:, c:c + 128] @ qb.double()[:, c:c + 128].T)
               * sa.double()[:, c // 128, None] * 1.37 * sb64[None, :, c // 128] for c in (0, 128))
    assert ((got - want).abs() <= want.abs() * 2.0 ** -8 + 1e-30).all()


def test_fp4_gemm_ref_is_the_formula():
    g = gen(3)
    packed = fp4_weight(g, 7, 128)
    codes = torch.stack((packed.view(torch.uint8) & 15, packed.view(torch.uint8) >> 4), -1)
    sign = torch.where(codes.flatten(-2) >= 8, -1.0, 1.0).double()
    c = codes.flatten(-2).long() & 7
    magnitude = torch.where(c < 2, c * 0.5, torch.pow(2.0, (c >> 1) - 1) * (1 + (c & 1) * 0.5))
    assert torch.equal(R.e2m1_to_float(packed).double(), sign * magnitude.double())
    qa = torch.randint(-6, 7, (3, 256), generator=g).float().to(torch.float8_e4m3fn)
    sa = torch.pow(2.0, torch.randint(-3, 3, (3, 2), generator=g).float())
    sb = e8m0(g, 7, 8, lo=124, hi=130)
    b = sign * magnitude.double() * R.e8m0_to_float(sb).double().repeat_interleave(32, -1)
    want = (qa.double() * sa.double().repeat_interleave(128, -1)) @ b.T
    assert torch.equal(R.fp4_gemm_ref(qa, sa, packed, sb), want.to(torch.bfloat16))


def reference_kernel_shims():
    """scripts/reference_oracle's stand-ins for the reference's TileLang kernels."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    try:
        from reference_oracle import kernel_shims
    finally:
        sys.path.pop(0)
    return kernel_shims


def test_references_equal_the_reference_oracles_kernel_stand_ins():
    """scripts/reference_oracle's stand-ins for the reference's TileLang act_quant, fp8_gemm and
    fp4_gemm (written apart, from the same kernels) give the same bytes."""
    K = reference_kernel_shims()
    g = gen(13)
    x = rows(g, 5, 512)
    for fmt in ("ue8m0", None):
        (q, s), (q_oracle, s_oracle) = act_quant(x, fmt), K.act_quant(x, 128, fmt)
        assert torch.equal(q.view(torch.uint8), q_oracle.view(torch.uint8))
        assert torch.equal(s, s_oracle)
    w, ws = fp8_weight(g, 300, 512), torch.rand(3, 4, generator=g) + 0.3
    assert same(R.fp8_gemm_ref(q, s, w, ws), K.fp8_gemm(q, s, w, ws).bfloat16())
    q, s = act_quant(x)
    packed, sb = fp4_weight(g, 300, 256), e8m0(g, 300, 16)
    assert same(R.fp4_gemm_ref(q, s, packed, sb),
                K.fp4_gemm(q, s, packed.view(torch.float4_e2m1fn_x2), sb).bfloat16())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # Triton interpreter
@pytest.mark.parametrize("case", ["partial_times_sa_overflows", "sa_times_sb_is_subnormal"])
def test_fp4_scales_multiply_left_to_right_as_the_reference(case):
    """fp4_gemm scales a 32-block's partial as (partial * sa) * sb in fp32, not
    partial * (sa * sb). With power-of-two weight scales the two differ only at the ends of
    fp32's range, and there the op gives the reference's bits too: rows near bf16's max, whose
    partial * sa overflows to inf though sb = 2^-20 would bring it back; plain (scale_fmt None)
    activation scales with weight scales of 2^-127..2^-125, whose product is an fp32
    subnormal that keeps only part of sa's bits."""
    K = reference_kernel_shims()
    g = gen(15)
    packed = fp4_weight(g, 1, 32, 64)
    if case == "partial_times_sa_overflows":    # positive weights: every partial has x's sign
        fmt, x = "ue8m0", torch.tensor([[3.0e38], [-3.0e38]]).expand(2, 128)
        sb, packed = torch.full((1, 32, 4), 107, dtype=torch.uint8), packed & 0x77
    else:
        fmt, x = None, torch.randn(64, 128, generator=g)
        sb = torch.randint(0, 3, (1, 32, 4), generator=g, dtype=torch.uint8)
    x, sb = x.bfloat16().contiguous(), sb.view(torch.float8_e8m0fnu)
    q, s = act_quant(x, fmt)
    want = K.fp4_gemm(q, s, packed[0].view(torch.float4_e2m1fn_x2), sb[0]).bfloat16()
    assert (want.isinf().all() if case == "partial_times_sa_overflows" else want.isfinite().all())
    offs = torch.tensor([x.shape[0]], dtype=torch.int32)
    for kernel in (TORCH, TRITON):
        assert same(fp4_grouped_linear(x, packed, sb, offs, scale_fmt=fmt, kernel=kernel),
                    want)


# ---- fnuz ---------------------------------------------------------------------------------------

def test_ocp_to_fnuz_on_every_byte():
    ocp = torch.arange(256, dtype=torch.uint8)
    nan = (ocp & 0x7F) == 0x7F
    fnuz, scale = ocp_to_fnuz(ocp[~nan].view(torch.float8_e4m3fn), torch.tensor([1.0]))
    assert fnuz.dtype == torch.float8_e4m3fnuz and scale.item() == 2.0
    assert torch.equal(fnuz.float() * scale, ocp[~nan].view(torch.float8_e4m3fn).float())
    kept = ocp[~nan] != 0x80
    assert torch.equal(fnuz.view(torch.uint8)[kept], ocp[~nan][kept])
    assert fnuz.view(torch.uint8)[ocp[~nan] == 0x80].tolist() == [0]
    for byte in (0x7F, 0xFF):
        with pytest.raises(ValueError, match="NaN byte"):
            ocp_to_fnuz(torch.tensor([0, byte], dtype=torch.uint8), torch.tensor([1.0]))


def test_ocp_to_fnuz_doubles_every_scale_format():
    w = torch.zeros(2, dtype=torch.float8_e4m3fn)
    _, s = ocp_to_fnuz(w, torch.tensor([127, 3], dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert s.dtype == torch.float8_e8m0fnu and s.float().tolist() == [2.0, 2.0 ** -123]
    _, s = ocp_to_fnuz(w, torch.tensor([127], dtype=torch.uint8))
    assert s.dtype == torch.uint8 and s.tolist() == [128]
    _, s = ocp_to_fnuz(w, torch.tensor([0.75], dtype=torch.bfloat16))
    assert s.dtype == torch.bfloat16 and s.item() == 1.5
    with pytest.raises(ValueError, match="2\\^127"):
        ocp_to_fnuz(w, torch.tensor([254], dtype=torch.uint8))
    with pytest.raises(TypeError, match="weight must have dtype"):
        ocp_to_fnuz(w.view(torch.int8), torch.tensor([1.0]))


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_fnuz_activations_dequantize_to_the_reference(scale_fmt):
    """Many rows with subnormal and saturating values: q * s is the reference's value exactly."""
    x = rows(gen(4), 64, 512)
    x[1, :128] = torch.linspace(-1, 1, 128).bfloat16() * 3.0e38   # x / s lands on +-448
    q_ocp, s_ocp = act_quant(x, scale_fmt, OCP)
    q_fnuz, s_fnuz = act_quant(x, scale_fmt, FNUZ)
    assert q_fnuz.dtype == torch.float8_e4m3fnuz
    ref = q_ocp.float().unflatten(-1, (-1, 128)) * s_ocp[..., None]
    got = q_fnuz.float().unflatten(-1, (-1, 128)) * s_fnuz[..., None]
    assert torch.equal(got, ref)
    assert (q_ocp.float().abs() == 448).any() and (q_ocp.float().abs() < 2.0 ** -6).any()
    b_ocp, b_fnuz = q_ocp.view(torch.uint8), q_fnuz.view(torch.uint8)
    assert torch.equal(torch.where(b_ocp == 0x80, 0, b_ocp), b_fnuz)


# ---- the ops: Triton (interpreter) against torch ------------------------------------------------

def same(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dialect", ["ocp", "fnuz"])
@pytest.mark.parametrize("scale", ["e8m0", "uint8", "fp32"])
def test_fp8_linear_triton_matches_torch(dialect, scale):
    g = gen(5)
    x = rows(g, 3, 256)
    w = fp8_weight(g, 200, 256)                    # N not a multiple of 64 or 128
    ws = e8m0(g, 2, 2)
    ws = {"e8m0": ws, "uint8": ws.view(torch.uint8), "fp32": ws.float() * 1.5}[scale]
    want = fp8_linear(x, w, ws, kernel=TORCH)
    if dialect == "fnuz":
        w, ws = ocp_to_fnuz(w, ws)
        assert same(fp8_linear(x, w, ws, kernel=TORCH), want)
    for fmt in ("ue8m0", None):
        ref = fp8_linear(x, w, ws, scale_fmt=fmt, kernel=TORCH) if fmt is None else want
        assert same(fp8_linear(x.to(DEV), w.to(DEV), ws.to(DEV), scale_fmt=fmt,
                               kernel=TRITON).cpu(), ref)


@pytest.mark.parametrize("dialect", ["ocp", "fnuz"])
def test_fp8_linear_fp32_output_is_the_unrounded_accumulator(dialect):
    """out_dtype float32 (a tensor-parallel rank's partial of a split K): the fp32 sum of the
    K blocks' scaled products, which the bf16 output rounds once; Triton equals torch."""
    g = gen(13)
    x, w, ws = rows(g, 3, 256), fp8_weight(g, 200, 256), e8m0(g, 2, 2)
    if dialect == "fnuz":
        w, ws = ocp_to_fnuz(w, ws)
    got = fp8_linear(x, w, ws, out_dtype=torch.float32, kernel=TORCH)
    q, s = act_quant(x, "ue8m0", FNUZ if dialect == "fnuz" else OCP)
    blocks = [R.fp8_gemm_ref(q[:, c:c + 128], s[:, c // 128:c // 128 + 1], w[:, c:c + 128],
                             ws[:, c // 128:c // 128 + 1], torch.float32) for c in (0, 128)]
    assert got.dtype == torch.float32 and torch.equal(got, blocks[0] + blocks[1])
    assert same(got.bfloat16(), fp8_linear(x, w, ws, kernel=TORCH))
    assert not torch.equal(got, got.bfloat16().float())
    triton_got = fp8_linear(x.to(DEV), w.to(DEV), ws.to(DEV), out_dtype=torch.float32,
                            kernel=TRITON)
    assert torch.equal(triton_got.cpu(), got)


@pytest.mark.parametrize("dialect", ["ocp", "fnuz"])
def test_fp8_grouped_linear_triton_matches_torch(dialect):
    g = gen(6)
    x = rows(g, 9, 256)
    w, ws = fp8_weight(g, 3, 64, 256), e8m0(g, 3, 1, 2)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)    # an empty group; row 8 in none
    if dialect == "fnuz":
        w, ws = zip(*(ocp_to_fnuz(w[e], ws[e]) for e in range(3)))
        w, ws = torch.stack(w), torch.stack(ws)
    want = fp8_grouped_linear(x, w, ws, offs, kernel=TORCH)
    assert torch.equal(want[8], torch.zeros_like(want[8]))
    for e, (lo, hi) in enumerate([(0, 3), (3, 8)]):
        e = (0, 2)[e]
        assert same(want[lo:hi], fp8_linear(x[lo:hi], w[e], ws[e], kernel=TORCH))
    got = fp8_grouped_linear(x.to(DEV), w.to(DEV), ws.to(DEV), offs.to(DEV), kernel=TRITON)
    assert same(got.cpu(), want)


@pytest.mark.parametrize("dialect", ["ocp", "fnuz"])
@pytest.mark.parametrize("packing", [torch.int8, torch.uint8, torch.float4_e2m1fn_x2],
                         ids=["int8", "uint8", "float4_e2m1fn_x2"])
def test_fp4_grouped_linear_triton_matches_torch(dialect, packing):
    """The activations are quantized in the KernelOptions' fp8 dialect."""
    d = FNUZ if dialect == "fnuz" else OCP
    g = gen(7)
    x = rows(g, 7, 256)
    w = fp4_weight(g, 2, 96, 128).view(packing)
    ws = e8m0(g, 2, 96, 8)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    want = fp4_grouped_linear(x, w, ws, offs, kernel=replace(TORCH, fp8_dialect=d))
    q, s = act_quant(x[2:6])
    assert same(want[2:6], R.fp4_gemm_ref(q, s, w[1], ws[1]))
    assert torch.equal(want[6], torch.zeros_like(want[6]))
    got = fp4_grouped_linear(x.to(DEV), w.to(DEV), ws.view(torch.uint8).to(DEV), offs.to(DEV),
                             kernel=replace(TRITON, fp8_dialect=d))
    assert same(got.cpu(), want)


def test_offs_past_the_rows_never_leave_them_without_value_checks():
    """Unchecked (value checks off, as in graph capture) offs past x's rows: the kernel clamps
    each group to the rows, so it writes only the rows that exist."""
    g = gen(12)
    x, w, ws = rows(g, 5, 128), fp4_weight(g, 2, 32, 64), e8m0(g, 2, 32, 4)
    unchecked = KernelOptions(backend="triton", value_checks=False)
    offs = torch.tensor([2, 9], dtype=torch.int32)
    got = fp4_grouped_linear(x.to(DEV), w.to(DEV), ws.to(DEV), offs.to(DEV), kernel=unchecked)
    want = fp4_grouped_linear(x, w, ws, torch.tensor([2, 5], dtype=torch.int32), kernel=TORCH)
    assert same(got.cpu(), want)


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
def test_grouped_linear_in_capture_gives_each_row_its_groups_result(fp4):
    """In a graph capture the torch path cannot read offs on the host: every expert's GEMM runs
    over all rows and each row keeps its own group's result, as eager gives it. offs [3, 3, 8]
    puts rows on group boundaries: row 3 opens expert 2's group after expert 1's empty one,
    row 8 is past the last group (0)."""
    g = gen(16)
    x, offs = rows(g, 9, 128), torch.tensor([3, 3, 8], dtype=torch.int32)
    if fp4:
        op, w, ws = fp4_grouped_linear, fp4_weight(g, 3, 32, 64), e8m0(g, 3, 32, 4)
    else:
        op, w, ws = fp8_grouped_linear, fp8_weight(g, 3, 32, 128), e8m0(g, 3, 1, 1)
    eager = op(x, w, ws, offs, kernel=TORCH)
    set_emulated_capture(True)
    try:
        captured = op(x, w, ws, offs, kernel=TORCH)
    finally:
        set_emulated_capture(False)
    assert same(captured, eager)
    assert torch.equal(captured[8], torch.zeros_like(captured[8]))


# ---- dispatcher, Meta, errors -------------------------------------------------------------

def small_args(g):
    return {"fp8_linear": (rows(g, 2, 128), fp8_weight(g, 64, 128), e8m0(g, 1, 1)),
            "fp8_grouped_linear": (rows(g, 2, 128), fp8_weight(g, 2, 64, 128), e8m0(g, 2, 1, 1),
                                   torch.tensor([1, 2], dtype=torch.int32)),
            "fp4_grouped_linear": (rows(g, 2, 128), fp4_weight(g, 2, 64, 64), e8m0(g, 2, 64, 4),
                                   torch.tensor([1, 2], dtype=torch.int32))}


@pytest.mark.parametrize("kernel", [TORCH, TRITON], ids=["torch", "triton"])
def test_each_call_is_one_dispatcher_op(kernel):
    fns = {"fp8_linear": fp8_linear, "fp8_grouped_linear": fp8_grouped_linear,
           "fp4_grouped_linear": fp4_grouped_linear}
    for name, args in small_args(gen(8)).items():
        assert op_names(lambda: fns[name](*args, kernel=kernel)) == [f"dsv4::{name}"]


@pytest.mark.parametrize("platform, weight_dtype, backend", [
    (OCP, torch.float8_e4m3fn, "triton"), (FNUZ, torch.float8_e4m3fnuz, "triton"),
    (FNUZ, torch.float8_e4m3fn, "torch")])
def test_triton_asked_runs_triton_unless_the_weights_are_ocp_on_an_fnuz_platform(
            platform, weight_dtype, backend):
    """The Triton kernels decode the weights in the KernelOptions' dialect (the platform's):
    published (OCP) e4m3fn weights on an fnuz platform (not converted at load) go to the torch
    reference."""
    g = gen(14)
    x, w, ws = small_args(g)["fp8_linear"]
    w = w.view(torch.uint8).clamp(max=0x7e).view(weight_dtype)   # no NaN in either dialect
    kernel = replace(TRITON, fp8_dialect=platform)
    calls = recorded_ops(lambda: fp8_linear(x, w, ws, kernel=kernel))
    assert [(name, overload) for name, overload, _ in calls] == [("dsv4::fp8_linear", backend)]


def test_meta_tensors_give_the_output_shape():
    args = small_args(gen(9))
    x, w, ws = (t.to("meta") for t in args["fp8_linear"])
    assert op("fp8_linear", "torch")(x, w, ws, True, torch.bfloat16).shape == (2, 64)
    assert op("fp8_linear", "triton")(x, w, ws, True, torch.float32).dtype == torch.float32
    x, w, ws, offs = (t.to("meta") for t in args["fp4_grouped_linear"])
    out = op("fp4_grouped_linear", "triton")(x, w, ws, offs, True, "ocp")
    assert out.shape == (2, 64) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["fp8_linear", "fp4_grouped_linear"])
def test_triton_output_is_on_the_inputs_device(family, monkeypatch):
    """On a CPU every tensor is on the CPU; "meta" stands in for a GPU here. The output the
    wrapper hands to its kernel (launch recorded, not run) and returns is on x's device, and so
    is an empty batch's (no launch)."""
    kernel = LaunchRecorder()
    monkeypatch.setattr(T, f"{family.split('_')[0]}_linear_kernel", kernel)
    x, w, ws, *offs = (t.to("meta") for t in small_args(gen(9))[family])
    offs = offs[0] if offs else None
    if offs is None:                                     # a dense linear is one group
        w, ws = w[None], ws[None]
    outs = [T.quant_linear_triton(r, w, ws, offs, True, family.startswith("fp4"), OCP)
            for r in (x, x[:0])]
    assert [(o.device, o.shape) for o in outs] == [(x.device, (2, 64)), (x.device, (0, 64))]
    ((launched, _),) = kernel.launches                   # the empty batch launches nothing
    args = [a for a in launched if isinstance(a, torch.Tensor)]
    assert any(a is outs[0] for a in args)
    assert all(a.device == x.device for a in args)


def test_bad_arguments_are_named():
    g = gen(10)
    x, w, ws = small_args(g)["fp8_linear"]
    cases = [
        (lambda: fp8_linear(x.float(), w, ws), TypeError, "x must have dtype torch.bfloat16"),
        (lambda: fp8_linear(x[:, :100], w[:, :100], ws), ValueError, "multiple of 128"),
        (lambda: fp8_linear(x, w.view(torch.uint8), ws), TypeError, "weight must have dtype"),
        (lambda: fp8_linear(x, w[:, :64], ws), ValueError, "weight must have shape"),
        (lambda: fp8_linear(x, w, ws.float().expand(2, 1)), ValueError,
         "weight_scale must have shape"),
        (lambda: fp8_linear(x, w, ws.view(torch.int8)), TypeError, "weight_scale must have dtype"),
        (lambda: fp8_linear(x, w, ws, scale_fmt="e4m3"), ValueError, "scale_fmt"),
        (lambda: fp8_linear(x, w, ws, out_dtype=torch.float16), ValueError, "out_dtype"),
        (lambda: fp8_linear(x, w, ws, kernel="torch"), TypeError, "kernel must be"),
    ]
    x4, w4, ws4, offs = small_args(g)["fp4_grouped_linear"]
    cases += [
        (lambda: fp4_grouped_linear(x4, w4, ws4, offs.long()), TypeError, "offs must have dtype"),
        (lambda: fp4_grouped_linear(x4, w4, ws4, offs[:1]), ValueError, "offs must have shape"),
        (lambda: fp4_grouped_linear(x4, w4, ws4, offs.flip(0)), ValueError, "non-decreasing"),
        (lambda: fp4_grouped_linear(x4, w4, ws4, offs + 1), ValueError, "x's 2 rows"),
        (lambda: fp4_grouped_linear(x4, w4, ws4.float(), offs), TypeError,
         "weight_scale must have dtype"),
        (lambda: fp4_grouped_linear(x4, w4[..., :32], ws4, offs), ValueError,
         "weight must have shape"),
        (lambda: fp4_grouped_linear(x4, w4[0], ws4, offs), ValueError, "weight must have shape"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
