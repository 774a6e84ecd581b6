"""The MoE of a decode step in three dispatcher ops:

    moe_route(x, gate_weight, bias | tid2eid)  -> torch.ops.dsv4.moe_route
        logits = x @ gate_weight^T in fp32, scores = score_func(logits); a biased gate picks the
        k experts of largest scores + bias, a hash gate takes tid2eid[input_id]; weights = the
        chosen scores, renormalised to sum 1 (not after softmax), times route_scale.
        -> (weights fp32 [N, k], expert indices int64 [N, k])
    moe_routed(x, weights, indices, w1, w3, w2)  -> torch.ops.dsv4.moe_routed
        the (token, expert) pairs sorted by expert (stable), the group offsets, the rows
        gathered, gate + up grouped GEMMs, SwiGLU with the clamp (gate <= limit, |up| <= limit)
        times the routing weight, the down grouped GEMM, and the sum over each token's experts
        (ascending expert order) -> fp32 [N, D]
    moe_shared(routed, x, w1, w3, w2)  -> torch.ops.dsv4.moe_shared
        (routed + the shared expert of x (the same clamped SwiGLU MLP)) in x's dtype

With tensor parallelism the ranks' routed sums are all-reduced between moe_routed and moe_shared
(the caller's collective; no op here communicates).

Weights: bf16 (scales None), or the published formats: routed experts FP4 (packed e2m1 [E, out,
in/2] + ue8m0 [E, out, in/32], ``fp4_grouped_linear``), the shared expert FP8 (+ 128x128 ue8m0
scales, ``fp8_linear``). The torch references are the model's code before the fusion op for op
(the quantized linears through `quant_linear`'s own torch path), so the reference numerics keep
their bits; the grouped GEMMs' torch path reads the group offsets on the host outside a capture.
The Triton kernels: routing in one launch, the routed and the shared experts in two each, no
sort (a (token, expert) pair is a row of its own): gate + up with the clamped SwiGLU and the
routing weight, then down with the weighted sum per token (routed) or the routed sum added
(shared). bf16 weights in `moe_fused_triton`; FP4 routed / FP8 shared experts in
`moe_fused_quant_triton`, which decodes the weight tiles in registers and quantizes the
activations as `quant_linear`'s kernels do (the same Triton helpers). They agree with the torch
references within a stated tolerance (sums in Triton's order, Triton's sigmoid), not bit for
bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import resolve
from .checks import check_kernel, check_tensor
from .library import define_op, op
from .options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from .platform import FNUZ
from .quant_linear import (FP4_SCALE_DTYPES, FP4_WEIGHT_DTYPES, FP8_SCALE_DTYPES,
                           FP8_WEIGHT_DTYPES)
from .quant_linear_ref import ACT_BLOCK, FP4_BLOCK, fp4_grouped_linear_ref, fp8_linear_ref

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def gate_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """The MoE gate's scores of fp32 logits [N, E]."""
    if score_func == "softmax":
        return logits.softmax(-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def gate_weights(scores: torch.Tensor, indices: torch.Tensor, score_func: str,
                 route_scale: float) -> torch.Tensor:
    """The chosen experts' weights: their scores, renormalised to sum 1 (not after softmax),
    times the route scale."""
    weights = scores.gather(1, indices)
    if score_func != "softmax":
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * route_scale


def biased_gate(logits: torch.Tensor, bias: torch.Tensor, k: int, route_scale: float,
                score_func: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch routing of a biased gate: the k experts of largest scores + bias, weighted by
    their scores. (weights fp32 [N, k], expert indices int64 [N, k])."""
    scores = gate_scores(logits, score_func)
    indices = (scores + bias).topk(k, dim=-1)[1]
    return gate_weights(scores, indices, score_func, route_scale), indices


def moe_route_ref(x, gate_weight, bias, tid2eid, input_ids, k, route_scale, score_func):
    logits = F.linear(x.float(), gate_weight.float())
    if tid2eid is None:
        return biased_gate(logits, bias, k, route_scale, score_func)
    scores = gate_scores(logits, score_func)
    indices = tid2eid[input_ids.long()]
    return gate_weights(scores, indices, score_func, route_scale), indices


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (no clamp when limit <= 0)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def moe_routed_ref(x, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, swiglu_limit,
                   dialect):
    n, k = indices.shape
    expert = indices.flatten()
    order = torch.argsort(expert, stable=True)              # pairs grouped by expert
    token = order // k
    counts = torch.zeros(w1.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x[token]

    def grouped(rows, w, scale):
        if scale is not None:
            return fp4_grouped_linear_ref(rows, w, scale, offs, True, dialect)
        return torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)

    h = weights.flatten()[order, None] * swiglu(grouped(xs, w1, w1_scale),
                                                grouped(xs, w3, w3_scale), swiglu_limit)
    out = grouped(h.to(x.dtype), w2, w2_scale)
    return torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device).index_add_(
        0, token, out.float())


def moe_shared_ref(routed, x, w1, w3, w2, w1_scale, w3_scale, w2_scale, swiglu_limit):
    def dense(v, w, scale):
        if scale is not None:
            return fp8_linear_ref(v, w, scale, True, torch.bfloat16)
        return F.linear(v, w)

    h = swiglu(dense(x, w1, w1_scale), dense(x, w3, w3_scale), swiglu_limit)
    return (routed + dense(h.to(x.dtype), w2, w2_scale)).to(x.dtype)


def _route_fake(x, gate_weight, bias, tid2eid, input_ids, k, *rest):
    n = x.shape[0]
    return x.new_empty(n, k, dtype=torch.float32), x.new_empty(n, k, dtype=torch.int64)


def _routed_fake(x, *rest):
    return x.new_empty(x.shape, dtype=torch.float32)


def _shared_fake(routed, x, *rest):
    return x.new_empty(x.shape)


MLP = "Tensor w1, Tensor w3, Tensor w2, Tensor? w1_scale, Tensor? w3_scale, Tensor? w2_scale"
define_op("moe_route", "(Tensor x, Tensor gate_weight, Tensor? bias, Tensor? tid2eid, "
          "Tensor? input_ids, int k, float route_scale, str score_func) -> (Tensor, Tensor)",
          moe_route_ref, _route_fake, triton="moe_fused_triton.moe_route_triton")
define_op("moe_routed", f"(Tensor x, Tensor weights, Tensor indices, {MLP}, float swiglu_limit, "
          "str dialect) -> Tensor", moe_routed_ref, _routed_fake,
          triton="moe_fused_quant_triton.moe_routed_triton")
define_op("moe_shared", f"(Tensor routed, Tensor x, {MLP}, float swiglu_limit) -> Tensor",
          moe_shared_ref, _shared_fake, triton="moe_fused_quant_triton.moe_shared_triton")


def _contiguous(*tensors) -> bool:
    return all(t.is_contiguous() for t in tensors)


def _check_mlp(x, w1, w3, w2, scales, n_experts: int | None) -> None:
    """w1, w3 [(E,) inter, D] and w2 [(E,) D, inter] (inter, D halved for packed FP4); scales
    all None (bf16 weights) or all tensors (FP8 / FP4)."""
    if any(s is None for s in scales) != all(s is None for s in scales):
        raise ValueError("w1_scale, w3_scale, w2_scale must be all None (bf16 weights) or all "
                         "tensors (FP8 / FP4 weights)")
    dim = 2 if n_experts is None else 3
    lead = () if n_experts is None else (n_experts,)
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        check_tensor(name, w, dim=dim, device=x.device)
        if n_experts is not None:
            check_tensor(name, w, shape=lead + (None, None))
    if w1.shape != w3.shape:
        raise ValueError(f"w1 and w3 must have one shape, got {tuple(w1.shape)} and "
                         f"{tuple(w3.shape)}")
    if scales[0] is not None:
        _check_quantized(x, w1, w3, w2, scales, n_experts)
    elif (w1.shape[-1] != x.shape[1] or w2.shape[-2] != x.shape[1]
          or w2.shape[-1] != w1.shape[-2]):
        raise ValueError(f"w1/w3 must be [{'E, ' if lead else ''}inter, {x.shape[1]}] and w2 "
                         f"[{'E, ' if lead else ''}{x.shape[1]}, inter], got {tuple(w1.shape)} "
                         f"and {tuple(w2.shape)}")


def _check_quantized(x, w1, w3, w2, scales, n_experts: int | None) -> None:
    """Routed FP4 (n_experts given): w1, w3 [E, inter, D/2] packed e2m1 with ue8m0 scales
    [E, inter, D/32], w2 [E, D, inter/2] with [E, D, inter/32]. Shared FP8: w1, w3 [inter, D],
    w2 [D, inter] with [ceil(out/128), in/128] block scales. D and inter multiples of 128 (the
    activations' quantization blocks)."""
    d, inter = x.shape[1], w1.shape[-2]
    if d % ACT_BLOCK or inter % ACT_BLOCK:
        raise ValueError(f"x's D and the experts' inter must be multiples of {ACT_BLOCK} with "
                         f"FP4 / FP8 weights, got D={d}, inter={inter}")
    if n_experts is None:
        def shapes(n_out, n_in):
            return (n_out, n_in), (-(-n_out // ACT_BLOCK), n_in // ACT_BLOCK)
        dtypes, scale_dtypes = FP8_WEIGHT_DTYPES, FP8_SCALE_DTYPES
    else:
        def shapes(n_out, n_in):
            return (n_experts, n_out, n_in // 2), (n_experts, n_out, n_in // FP4_BLOCK)
        dtypes, scale_dtypes = FP4_WEIGHT_DTYPES, FP4_SCALE_DTYPES
    for name, w, scale, (n_out, n_in) in (("w1", w1, scales[0], (inter, d)),
                                          ("w3", w3, scales[1], (inter, d)),
                                          ("w2", w2, scales[2], (d, inter))):
        shape, scale_shape = shapes(n_out, n_in)
        check_tensor(name, w, dtypes=dtypes, shape=shape)
        check_tensor(name + "_scale", scale, dtypes=scale_dtypes, shape=scale_shape,
                     device=x.device)
    for what, ts in (("w1, w3, w2", (w1, w3, w2)), ("w1_scale, w3_scale, w2_scale", scales)):
        if len({t.dtype for t in ts}) > 1:
            raise TypeError(f"{what} must have one dtype, got {[t.dtype for t in ts]}")


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, k: int, route_scale: float,
              score_func: str, *, bias: torch.Tensor | None = None,
              tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
              kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE gate of x [N, D]: (weights fp32 [N, k], expert indices int64 [N, k]). gate_weight
    [E, D]; either bias fp32 [E] (a biased gate) or tid2eid int64 [vocab, k] with input_ids [N]
    (a hash gate)."""
    check_kernel(kernel)
    check_tensor("x", x, dim=2)
    n_experts = gate_weight.shape[0] if isinstance(gate_weight, torch.Tensor) else 0
    check_tensor("gate_weight", gate_weight, shape=(None, x.shape[1]), device=x.device)
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r}: expected one of {SCORE_FUNCS}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
        raise ValueError(f"k={k!r}: expected an int in [1, {n_experts}] (the experts)")
    if (bias is None) == (tid2eid is None):
        raise ValueError("give exactly one of bias (a biased gate) and tid2eid (a hash gate)")
    if bias is not None:
        check_tensor("bias", bias, shape=(n_experts,), device=x.device)
    else:
        check_tensor("tid2eid", tid2eid, shape=(None, k), device=x.device)
        check_tensor("input_ids", input_ids, shape=(x.shape[0],), device=x.device)
    backend = resolve("moe_route", x.device, kernel.backend,
                      triton_ok=_contiguous(gate_weight, *([] if tid2eid is None else [tid2eid])))
    return op("moe_route", backend)(x.contiguous(), gate_weight, bias, tid2eid, input_ids, k,
                                    float(route_scale), score_func)


def moe_routed(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor,
               w3: torch.Tensor, w2: torch.Tensor, *, w1_scale: torch.Tensor | None = None,
               w3_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
               swiglu_limit: float = 0.0,
               kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """The routed experts' weighted sum, fp32 [N, D], of x [N, D] (bf16) routed by `moe_route`'s
    (weights, indices). w1, w3 [E, inter, D], w2 [E, D, inter]: bf16, or packed FP4 with
    their ue8m0 scales (see the module docstring)."""
    check_kernel(kernel)
    check_tensor("x", x, dim=2)
    check_tensor("indices", indices, dtype=torch.int64, dim=2, device=x.device)
    check_tensor("weights", weights, dtype=torch.float32, shape=tuple(indices.shape),
                 device=x.device)
    if indices.shape[0] != x.shape[0]:
        raise ValueError(f"indices must have x's {x.shape[0]} rows, got {tuple(indices.shape)}")
    scales = (w1_scale, w3_scale, w2_scale)
    _check_mlp(x, w1, w3, w2, scales, w1.shape[0] if isinstance(w1, torch.Tensor) else None)
    backend = resolve("moe_routed", x.device, kernel.backend,
                      triton_ok=_contiguous(w1, w3, w2, *(s for s in scales if s is not None)))
    return op("moe_routed", backend)(x.contiguous(), weights, indices, w1, w3, w2, *scales,
                                     float(swiglu_limit), kernel.fp8_dialect.name)


def moe_shared(routed: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               w2: torch.Tensor, *, w1_scale: torch.Tensor | None = None,
               w3_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
               swiglu_limit: float = 0.0,
               kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS) -> torch.Tensor:
    """(routed fp32 [N, D] + the shared expert of x [N, D]) in x's dtype. w1, w3 [inter, D],
    w2 [D, inter]: bf16, or FP8 with 128x128 ue8m0 scales."""
    check_kernel(kernel)
    check_tensor("x", x, dim=2)
    check_tensor("routed", routed, dtype=torch.float32, shape=tuple(x.shape), device=x.device)
    scales = (w1_scale, w3_scale, w2_scale)
    _check_mlp(x, w1, w3, w2, scales, None)
    fnuz_ocp = kernel.fp8_dialect is FNUZ and w1.dtype == torch.float8_e4m3fn   # as fp8_linear
    backend = resolve("moe_shared", x.device, kernel.backend,
                      triton_ok=_contiguous(w1, w3, w2, *(s for s in scales if s is not None))
                      and not fnuz_ocp)
    return op("moe_shared", backend)(routed, x.contiguous(), w1, w3, w2, w1_scale, w3_scale,
                                     w2_scale, float(swiglu_limit))
