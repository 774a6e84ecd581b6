"""The monokernel's weights read in place: this project's parameters that are SGLang's loaded
parameters (or row slices of them), by name.

SGLang 0.5.23's DeepseekV4ForCausalLM keeps some weights, after its post-load conversion on ROCm,
in exactly the layout this project's layers read (its `deepseek_v4.py`, `fp8.py`, `fp8_utils.py`
read for this). `table(config, split, fnuz)` maps each such parameter of ours (its reference
checkpoint name) to SGLang's parameter (its path in `named_parameters()`), the rows of it that
are ours, and the dtype SGLang holds it in after loading:

- embedding, mHC (`hc_*`), the gate's weight, the compressors' norms, the ratio-128 compressors'
  `ape`: the same tensor (SGLang splits the vocabulary rows as this project does);
- `attn_sink`, the indexer's `weights_proj`: SGLang holds every head on every rank; ours are the
  rank's rows;
- on an fnuz platform (gfx942) the FP8 dense weights: `wq_a` and `wkv` are the two row ranges of
  SGLang's fused `wqkv_a`; `wq_b`, `wo_b` are split as ours; the indexer's `wq_b` is replicated
  (the rank's rows). SGLang makes them fnuz in place with the same bytes ours hold. Their scales
  are SGLang's fp32 ones doubled, ours are ue8m0: `SCALE` entries are converted (exactly, the
  scales are powers of two) into our model's own tensors, not read in place.
- the LM head is listed, but SGLang holds it in bf16 and ours is fp32: it is copied.

Nothing else is (the norms are bf16 in SGLang and fp32 here, the compressors' projections are
rounded to bf16 and fused, the ratio-4 `ape` is re-laid out, the experts' scales are shuffled by
aiter, and on gfx950 the FP8 dense weights are shuffled into aiter's 16x16 tiles).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..parallel import TensorSplit
from ..parallel.shards import part_range

logger = logging.getLogger(__name__)

VIEW = "view"      # ours is SGLang's tensor, or a row slice of it
SCALE = "scale"    # ours (ue8m0) is converted from SGLang's fp32 scale: held by our model

FP8_BLOCK = 128
FNUZ = torch.float8_e4m3fnuz


@dataclass(frozen=True)
class Entry:
    """Our parameter ``ours`` is rows ``rows`` (None: all) of SGLang's ``theirs``, which SGLang
    holds as ``dtype`` once loaded; ``kind`` names the group in logs and accounting."""
    ours: str
    theirs: str
    kind: str
    dtype: torch.dtype
    rows: tuple[int, int] | None = None
    how: str = VIEW


def _own_rows(split: TensorSplit, name: str, full_rows: int) -> tuple[int, int] | None:
    """The rank's rows of a tensor SGLang replicates and this project splits by rows."""
    part = part_range(split, name, (full_rows,))
    return None if part is None else (part[1], part[1] + part[2])


def _fp8(ours: str, theirs: str, rows: tuple[int, int] | None, kind: str) -> list[Entry]:
    srows = None if rows is None else (rows[0] // FP8_BLOCK, -(-rows[1] // FP8_BLOCK))
    return [Entry(f"{ours}.weight", f"{theirs}.weight", kind, FNUZ, rows),
            Entry(f"{ours}.scale", f"{theirs}.weight_scale_inv", kind, torch.float32, srows,
                  SCALE)]


def table(config: ModelConfig, split: TensorSplit, fnuz: bool) -> dict[str, Entry]:
    """Our parameter name -> its Entry, for this rank (``fnuz``: the FP8 dense weights too)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    out = [Entry("embed.weight", "model.embed_tokens.weight", "embedding", bf16),
           Entry("head.weight", "lm_head.weight", "lm head", bf16)]
    out += [Entry(f"hc_head_{p}", f"model.hc_head_{p}", "mHC", fp32)
            for p in ("fn", "base", "scale")]
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        attn, sattn = ours + "attn.", theirs + "self_attn."
        out += [Entry(f"{ours}hc_{s}_{p}", f"{theirs}hc_{s}_{p}", "mHC", fp32)
                for s in ("attn", "ffn") for p in ("fn", "base", "scale")]
        out.append(Entry(attn + "attn_sink", sattn + "attn_sink", "attn_sink", fp32,
                         _own_rows(split, attn + "attn_sink", config.n_heads)))
        out.append(Entry(ours + "ffn.gate.weight", theirs + "mlp.gate.weight", "gate", bf16))
        if fnuz:
            q = config.q_lora_rank
            out += _fp8(attn + "wq_a", sattn + "wqkv_a", (0, q), "fp8 dense")
            out += _fp8(attn + "wkv", sattn + "wqkv_a", (q, q + config.head_dim), "fp8 dense")
            out += _fp8(attn + "wq_b", sattn + "wq_b", None, "fp8 dense")
            out += _fp8(attn + "wo_b", sattn + "wo_b", None, "fp8 dense")
        ratio = config.compress_ratios[i]
        if ratio:
            out.append(Entry(attn + "compressor.norm.weight", sattn + "compressor.norm.weight",
                             "compressor norm", fp32))
        if ratio == 128:
            out.append(Entry(attn + "compressor.ape", sattn + "compressor.ape", "ape (ratio 128)",
                             fp32))
        if ratio == 4:
            idx, sidx = attn + "indexer.", sattn + "indexer."
            rows = _own_rows(split, idx + "weights_proj.weight", config.index_n_heads)
            out.append(Entry(idx + "weights_proj.weight", sidx + "weights_proj.weight",
                             "indexer weights_proj", bf16, rows))
            out.append(Entry(idx + "compressor.norm.weight", sidx + "compressor.norm.weight",
                             "compressor norm", fp32))
            if fnuz:
                rows = _own_rows(split, idx + "wq_b.weight",
                                 config.index_n_heads * config.index_head_dim)
                out += _fp8(idx + "wq_b", sidx + "wq_b", rows, "fp8 dense")
    return {e.ours: e for e in out}


def their_view(entry: Entry, tensor: torch.Tensor) -> torch.Tensor:
    """The part of SGLang's tensor that is ours (a view: no copy)."""
    if entry.rows is None:
        return tensor
    return tensor[entry.rows[0]:entry.rows[1]]


def mismatch(entry: Entry, theirs: torch.Tensor | None, ours: torch.Tensor,
             their_dtype: torch.dtype | None = None) -> str | None:
    """Why SGLang's tensor cannot serve our parameter as ``entry`` says (None: it can).
    ``their_dtype``: the dtype SGLang's tensor must have now (default: ``entry.dtype``, the
    post-load one; before loading, SGLang's FP8 weights are still e4m3fn)."""
    if theirs is None:
        return f"SGLang's model has no parameter {entry.theirs}"
    if getattr(theirs, "is_shuffled", False):
        return f"{entry.theirs} was shuffled into aiter's tiles after loading"
    want = entry.dtype if their_dtype is None else their_dtype
    if theirs.dtype != want:
        return f"{entry.theirs} is {theirs.dtype}, expected {want}"
    if entry.rows is not None and entry.rows[1] > theirs.shape[0]:
        return f"{entry.theirs} has {theirs.shape[0]} rows, ours are rows {list(entry.rows)}"
    view = their_view(entry, theirs)
    if tuple(view.shape) != tuple(ours.shape):
        return f"{entry.theirs} gives shape {list(view.shape)}, ours is {list(ours.shape)}"
    if entry.how == VIEW:
        if ours.dtype != entry.dtype:
            return f"ours is {ours.dtype}, SGLang's {entry.theirs} is {entry.dtype}"
        if not view.is_contiguous():
            return f"{entry.theirs} is not contiguous"
    return None


_LOGGED: set[str] = set()


def log_copy_once(kind: str, reason: str) -> None:
    """Log, once per kind of weight, why it is copied rather than read in place."""
    if kind not in _LOGGED:
        _LOGGED.add(kind)
        logger.info("dsv4-rocm monokernel: %s copied, not read in place: %s", kind, reason)


def load_dtype(entry: Entry) -> torch.dtype:
    """The dtype SGLang's tensor has while the checkpoint loads (before its FP8 weights are
    made fnuz)."""
    return torch.float8_e4m3fn if entry.dtype == FNUZ else entry.dtype


def bind(ours: torch.Tensor, entry: Entry, theirs: torch.Tensor) -> None:
    """Make our parameter SGLang's tensor (VIEW), or fill it from SGLang's scale (SCALE)."""
    view = their_view(entry, theirs)
    if entry.how == VIEW:
        ours.data = view
        return
    e8 = view.to(ours.dtype)
    if not torch.equal(e8.float(), view.float()):
        raise ValueError(f"{entry.theirs}: scales that are not powers of two cannot be held as "
                         f"{ours.dtype}")
    ours.copy_(e8)


def inplace_bytes(config: ModelConfig, tp: int, fnuz: bool, ours: dict[str, torch.Tensor]
                  ) -> int:
    """Bytes of rank 0's parameters ``ours`` (the model's tensors by name, e.g. on meta) that
    are read in place when SGLang's tensors are as its source says (the dtype each entry
    declares; FP8 bytes count as one byte each whatever the dialect)."""
    total = 0
    for name, e in table(config, TensorSplit(0, tp), fnuz).items():
        t = ours[name]
        same = t.dtype == e.dtype or (t.element_size() == 1 and e.dtype == FNUZ)
        if e.how == VIEW and same:
            total += t.numel() * t.element_size()
    return total
