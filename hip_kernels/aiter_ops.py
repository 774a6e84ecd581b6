"""Optional aiter kernels (AMD's ROCm op library) for ops whose semantics map exactly onto them.

aiter is never required: every op here has a torch path, the code the model ran before, and that
path runs whenever aiter is not used (the MoE gate's torch path is the gate's own math in
``dsv4.layers.moe``: ``moe_gate`` returns None for a call aiter does not take). The policy is
``KernelOptions.aiter`` (``DSV4_AITER``), each op's ``kernel`` argument, with the numerics mode
(``numerics``, one of ``numerics.MODES``) the op's caller runs:

- ``auto`` (the default): aiter runs an op only when aiter is importable, the op's tensors are on
  a ROCm GPU, and the numerics mode is ``fp32``. aiter's kernels do not reproduce the reference
  code's bits (a top-k breaks ties in its own order; aiter's other kernels round differently), so
  in the default ``reference`` numerics auto keeps the bit-exact torch path.
- ``1``: aiter runs every op it provides, whatever the numerics mode and whatever the tensors'
  device (aiter's own checks then refuse tensors it cannot take, e.g. CPU ones); an error naming
  DSV4_AITER if aiter cannot be imported at all.
- ``0``: never; aiter is not even imported.

A call outside what the aiter kernel supports (a dtype it lacks, k above its limit, an empty
batch) takes the torch path in every mode.

Ops:

- :func:`topk_rows` (the indexer's top-k per row) -> ``aiter.topk_plain(x, topk_ids, topk_out,
  topk, largest=True, rowStarts=None, rowEnds=None, stride0=-1, stride1=1)``: fp32/fp16/bf16
  rows, int32 ids, k <= 2048; it leaves the k winners unordered, so they are sorted here by value,
  descending, as ``torch.topk`` returns them.

- :func:`moe_gate` (the MoE gate of a non-hash layer) -> ``aiter.topk_gating(topk_weights,
  topk_indices, gating_output, correction_bias, need_renorm, routed_scaling_factor,
  score_func)``: one fused kernel for the score function (sqrt-softplus, DeepSeek-V4's; sigmoid;
  softmax), the biased top-k, the renormalisation of the chosen scores (not after softmax) and
  the route scale; fp32 logits, int32 indices. The experts' order within a row may differ from
  torch's; the MoE sums a token's experts in expert order, so the order does not matter.

The probe runs once per process (on the first call that may use aiter) and logs one line saying
which ops run on aiter and which take the torch path.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch

from . import platform
from .checks import check_kernel
from .numerics import check_mode
from .options import AITER_MODES, DEFAULT_KERNEL_OPTIONS, KernelOptions

logger = logging.getLogger(__name__)

# The ops dispatched here -> the aiter attribute each one calls.
DISPATCHED = {"topk_rows": "topk_plain", "moe_gate": "topk_gating"}
# Parameters an aiter op must take for the call made here; older aiter releases had a
# topk_plain(x, topk_ids, topk, largest) without the values output, which counts as missing.
REQUIRED_PARAMS = {"topk_plain": ("x", "topk_ids", "topk_out", "topk", "largest"),
                   "topk_gating": ("topk_weights", "topk_indices", "gating_output",
                                   "correction_bias", "need_renorm", "routed_scaling_factor",
                                   "score_func")}
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")

TOPK_MAX_K = 2048  # topk_plain's largest k (its kernels' MAX_CAPACITY)
TOPK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class AiterUnavailableError(RuntimeError):
    """DSV4_AITER=1 but the aiter package cannot be imported."""


@dataclass(frozen=True)
class AiterProbe:
    """What the installed aiter offers: ``available`` holds the names (keys of DISPATCHED)
    whose aiter attribute exists; ``error`` says why aiter did not import."""

    importable: bool
    available: frozenset[str] = frozenset()
    error: str | None = None

    def has(self, op: str) -> bool:
        return op in self.available

    def summary(self) -> str:
        """The probe's log line."""
        if not self.importable:
            return (f"aiter not importable ({self.error}); torch path for every op: "
                    + ", ".join(DISPATCHED))
        on = [f"{op} (aiter.{a})" for op, a in DISPATCHED.items() if op in self.available]
        off = [f"{op} (no aiter.{a})" for op, a in DISPATCHED.items() if op not in self.available]
        return (f"aiter importable; on aiter when DSV4_AITER allows: {', '.join(on) or 'none'}; "
                f"torch path: {', '.join(off) or 'none'}")


def _import_aiter():
    import aiter
    return aiter


def _has_op(mod, attr: str) -> bool:
    """Whether aiter has ``attr`` as a callable taking the parameters this module passes (when
    its signature can be read; a compiled op without one is taken at its word)."""
    fn = getattr(mod, attr, None)
    if not callable(fn):
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        return True
    return all(name in params for name in REQUIRED_PARAMS.get(attr, ()))


@functools.lru_cache(maxsize=None)
def probe() -> AiterProbe:
    """Import aiter once and record which of the ops named here it has (logged once)."""
    try:
        mod = _import_aiter()
    except Exception as e:  # aiter's import can fail in many ways (missing ROCm, JIT build)
        result = AiterProbe(False, error=f"{type(e).__name__}: {e}")
    else:
        result = AiterProbe(True, frozenset(op for op, attr in DISPATCHED.items()
                                            if _has_op(mod, attr)))
    logger.info("%s", result.summary())
    return result


def use_aiter(op: str, *tensors: torch.Tensor, aiter: str, numerics: str) -> bool:
    """Whether the policy ``aiter`` (auto|0|1) sends this call of ``op`` (a key of DISPATCHED)
    to aiter, for a caller running numerics mode ``numerics`` (reference|fp32)."""
    if op not in DISPATCHED:
        raise ValueError(f"op={op!r}: expected one of {sorted(DISPATCHED)}")
    if aiter not in AITER_MODES:
        raise ValueError(f"aiter={aiter!r}: expected one of {'|'.join(AITER_MODES)}")
    check_mode(numerics)
    if aiter == "0":
        return False
    if aiter == "1":
        found = probe()
        if not found.importable:
            raise AiterUnavailableError(
                f"aiter=1 (DSV4_AITER=1) but aiter cannot be imported ({found.error}); install "
                "aiter (ROCm only) or use aiter auto or 0")
        return found.has(op)
    # auto: the cheap conditions first, so a CPU run or the reference numerics never import aiter
    if numerics != "fp32" or platform.backend() != "rocm":
        return False
    if not all(t.device.type == "cuda" for t in tensors):
        return False
    return probe().has(op)


def _topk_supported(scores: torch.Tensor, k: int) -> bool:
    """Whether topk_plain takes this call: its dtypes, 1 <= k <= 2048, rows present, int32 ids."""
    return (scores.dtype in TOPK_DTYPES and 1 <= k <= TOPK_MAX_K and scores.shape[0] > 0
            and scores.shape[1] < 2 ** 31)


def _topk_torch(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return scores.topk(k, dim=-1)


def _topk_aiter(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = scores.contiguous()
    ids = torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device)
    vals = torch.empty(x.shape[0], k, dtype=x.dtype, device=x.device)
    _import_aiter().topk_plain(x, ids, vals, k, True)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    return vals, ids.long().gather(-1, order)


def topk_rows(scores: torch.Tensor, k: int, *, numerics: str = "reference",
              kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of scores [N, T], like ``scores.topk(k, dim=-1)``:
    (values [N, k] in scores' dtype, descending; int64 indices [N, k]). On aiter (as
    kernel.aiter and numerics allow), equal values may come in another order than torch's
    (torch leaves that order unspecified too)."""
    check_kernel(kernel)
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        raise ValueError(f"scores: expected a 2-D tensor [N, T], got "
                         f"{getattr(scores, 'shape', type(scores).__name__)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= scores.shape[1]:
        raise ValueError(f"k={k!r}: expected an int in [0, {scores.shape[1]}] (the row length)")
    return topk_by(scores, k, topk_uses_aiter(scores, k, numerics=numerics, kernel=kernel))


def topk_uses_aiter(scores: torch.Tensor, k: int, *, numerics: str,
                    kernel: KernelOptions) -> bool:
    """Whether ``topk_rows`` runs this call on aiter (the policy, then what topk_plain takes)."""
    return (use_aiter("topk_rows", scores, aiter=kernel.aiter, numerics=numerics)
            and _topk_supported(scores, k))


def topk_by(scores: torch.Tensor, k: int, aiter: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_rows`` on the implementation already chosen (``topk_uses_aiter``), unchecked:
    for the fused ops that contain it."""
    return _topk_aiter(scores, k) if aiter else _topk_torch(scores, k)


def _moe_gate_aiter(logits, bias, k, route_scale, score_func):
    n = logits.shape[0]
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int32, device=logits.device)
    _import_aiter().topk_gating(weights, ids, logits.contiguous(), bias.float().contiguous(),
                                score_func != "softmax", float(route_scale), score_func)
    return weights, ids.long()


def moe_gate(logits: torch.Tensor, bias: torch.Tensor, k: int, route_scale: float,
             score_func: str, *, numerics: str = "reference",
             kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The routing of a biased MoE gate on aiter: scores = score_func(logits [N, E] fp32), the k
    experts of largest scores + bias [E], their scores renormalised (not after softmax) times
    route_scale. (weights fp32 [N, k], expert indices int64 [N, k]), or None when the policy
    keeps this call on torch (kernel.aiter and numerics decide): the caller then runs its own
    gate math (``dsv4.layers.moe``)."""
    check_kernel(kernel)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits: expected an fp32 tensor [N, E], got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (logits.shape[1],):
        raise ValueError(f"bias: expected a tensor [{logits.shape[1]}] (one per expert), got "
                         f"{tuple(getattr(bias, 'shape', ()))}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k={k!r}: expected an int in [1, {logits.shape[1]}] (the experts)")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r}: expected one of {SCORE_FUNCS}")
    if logits.shape[0] and use_aiter("moe_gate", logits, bias, aiter=kernel.aiter,
                                     numerics=numerics):
        return _moe_gate_aiter(logits, bias, k, route_scale, score_func)
    return None
