"""Which rounding the model runs (`DSV4_NUMERICS`), for the ops that read it.

- "reference" (the default): every rounding point follows DeepSeek-V4's reference inference code:
  the q RMSNorm op by op in bf16, the kv RMSNorm's mean of squares summed in fp32, the Hadamard
  rotation as fp32 butterflies with one rounding, the indexer's scores in bf16, the sparse
  attention in 64-row blocks with bf16 probabilities, the Sinkhorn's first row normalisation a
  true division. Eager decode then gives the reference's bits for the same batch, and, like the
  reference, a request's logits depend slightly on the batch it shares (bf16 GEMM shapes).
- "fp32": the intermediates of those points stay fp32 and the norms sum exactly, so a request's
  logits are stable across batch compositions within fp32 tolerances, and every set-KV backend
  writes the same bytes for any input.
"""

from __future__ import annotations

from . import envs
from .kv_layout import DEFAULT_NUMERICS, REFERENCE_NUMERICS, StoreNumerics

MODES = ("reference", "fp32")


def mode() -> str:
    """DSV4_NUMERICS, read at each call (a captured graph keeps the mode it was captured in)."""
    return envs.NUMERICS.get()


def is_reference() -> bool:
    return mode() == "reference"


def store_numerics() -> StoreNumerics:
    """The set-KV numerics of the model's own stores in the current mode."""
    return REFERENCE_NUMERICS if is_reference() else DEFAULT_NUMERICS
