"""The monokernel's weights: checkpoint tensors seen at load, this project's model built from them.

SGLang's loader passes each checkpoint tensor through the spec's `load_tensor(copies, model,
name, tensor)` before converting it (`monokernel_weights_iterator`). Some of this project's
parameters are SGLang's own loaded parameters, read in place (`sglang_mono_inplace`: which, and
the check that SGLang's tensor is what they need; a tensor that fails it is copied, the reason
logged once per kind). For the others `load_tensor` keeps, in host memory, what this TP rank's
part of the model reads: of every non-MTP tensor but other ranks' routed experts and those read
in place, the rank's slice (the whole tensor where the split does not cut it). `build_model` then builds this project's `DeepseekV4Model` on the device, makes
the in-place parameters views of SGLang's tensors, fills the rest from the host copies with the
checkpoint loader (`dsv4.weights.loader.fill_from`: every name and shape checked first, FP8 made
fnuz exactly on gfx942, the rank's slices), and drops the copies. What stays is what the model
holds itself: `copies` lists it under `MODEL`, so SGLang's log line and `python -m dsv4 env`
state the bytes held beside SGLang's weights.
"""

from __future__ import annotations

import logging

import torch

from ..config import ModelConfig
from ..memory_estimate import weight_bytes
from ..model import DeepseekV4Model
from ..options import Options
from ..layers.quant_linear import fp8_weight_dtype
from ..parallel import SINGLE, TensorSplit
from ..parallel import shards
from ..parallel.shards import expert_of
from ..weights import loader
from ..weights.held import HeldTensors
from ..weights.names import is_mtp, to_reference
from . import sglang_mono_inplace as inplace
from .sglang_mono_config import hf_dict, model_config

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint"          # copies' kind: the host copies load_tensor keeps until build
MODEL = "dsv4-rocm model"          # copies' kind: the device tensors of this project's model
WHERE = "SGLang's checkpoint tensors (monokernel load_tensor)"


def weight_format(hf: dict) -> str | None:
    """"native" for the published format (FP8 e4m3 in 128x128 blocks, ue8m0 scales, FP4
    experts), "bf16" for an unquantized checkpoint, None for any other quantization."""
    qc = hf.get("quantization_config")
    if not qc:
        return "bf16"
    qc = qc if isinstance(qc, dict) else vars(qc)
    block = [int(b) for b in qc.get("weight_block_size") or (128, 128)]
    if (qc.get("quant_method") == "fp8" and block == [128, 128]
            and qc.get("scale_fmt", "ue8m0") == "ue8m0"):
        return "native"
    return None


def rank_split() -> TensorSplit:
    """This process's TP rank in SGLang's tensor-parallel group, as this project's split."""
    from sglang.srt.runtime_context import get_parallel

    group = get_parallel().tp_group
    if group.world_size == 1:
        return SINGLE
    return TensorSplit(group.rank_in_group, group.world_size, group.device_group)


def _owns(split: TensorSplit, name: str, n_experts: int) -> bool:
    expert = expert_of(name)
    if expert is None or split.size == 1:
        return True
    per = n_experts // split.size
    return split.rank * per <= expert < (split.rank + 1) * per


def in_place(model: torch.nn.Module) -> dict[str, inplace.Entry]:
    """Our parameters read in place from SGLang's ``model`` (its parameters as created, before
    the checkpoint loads): the table's entries whose SGLang tensor passes the check; each other
    kind's reason is logged once. Made once per SGLang model."""
    cached = _IN_PLACE.get(id(model))
    if cached is not None and cached[0] is model:
        return cached[1]
    config = model_config(model.config)
    hf = hf_dict(model.config)
    fmt, split = weight_format(hf), rank_split()
    ours = DeepseekV4Model(config, device="meta", max_seq_len=max_seq_len(hf, config),
                           weights=fmt, split=split).state_dict()
    theirs = dict(model.named_parameters())
    fnuz = fmt == "native" and fp8_weight_dtype() == inplace.FNUZ
    served = {}
    for name, entry in inplace.table(config, split, fnuz).items():
        why = inplace.mismatch(entry, theirs.get(entry.theirs), ours[name],
                               inplace.load_dtype(entry))
        if why is None:
            served[name] = entry
        else:
            inplace.log_copy_once(entry.kind, why)
    _IN_PLACE.clear()
    _IN_PLACE[id(model)] = (model, served)
    return served


_IN_PLACE: dict[int, tuple[torch.nn.Module, dict]] = {}


def _ours(ref: str, is_scale: bool) -> str:
    return ref[:-len("weight")] + "scale" if is_scale else ref


def load_tensor(copies: dict, model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Keep a host copy of a checkpoint tensor this rank's model reads and does not read in
    place from SGLang's model (the spec's load hook)."""
    config = model.config
    ref, is_scale = to_reference(name)
    if is_mtp(ref, config.num_hidden_layers):
        return
    if not _owns(rank_split(), ref, config.n_routed_experts):
        return
    target = _ours(ref, is_scale)
    if target in in_place(model):
        return
    part = shards.part_range(rank_split(), target, tuple(tensor.shape))
    kept = tensor if part is None else tensor.narrow(*part)
    copies[(CHECKPOINT, name, tuple(tensor.shape), part)] = kept.detach().to("cpu", copy=True)


# SGLang's request table is a few columns wider than its context length (4 in 0.5.23); the
# RoPE tables cover that much more, so a table of that width is served.
REQUEST_TABLE_HEADROOM = 64


def max_seq_len(hf: dict, config: ModelConfig) -> int:
    """The positions the model's RoPE tables hold: the longer of the config's
    max_position_embeddings and the context length SGLang serves, plus the request table's
    headroom."""
    context = max(int(hf.get("max_position_embeddings") or config.original_seq_len),
                  int(hf.get("context_len") or 0))
    return context + REQUEST_TABLE_HEADROOM


def model_bytes(config: ModelConfig, fmt: str, tp: int, seq_len: int) -> int:
    """Device bytes of this project's whole model on one of ``tp`` ranks."""
    return weight_bytes(config, fmt, max_seq_len=seq_len, tp=tp)


def in_place_bytes(config: ModelConfig, fmt: str, tp: int, fnuz: bool) -> int:
    """Bytes of rank 0's model read in place from SGLang's tensors, as SGLang's source says
    they are laid out after loading (``fnuz``: on gfx942)."""
    ours = DeepseekV4Model(config, device="meta", max_seq_len=1, weights=fmt,
                           split=TensorSplit(0, tp)).state_dict()
    return inplace.inplace_bytes(config, tp, fnuz and fmt == "native", ours)


def copy_bytes(config: ModelConfig, fmt: str, tp: int, seq_len: int, fnuz: bool) -> int:
    """Device bytes the monokernel holds on one of ``tp`` ranks beside SGLang's own weights:
    its model less what it reads in place."""
    return model_bytes(config, fmt, tp, seq_len) - in_place_bytes(config, fmt, tp, fnuz)


def copied_bytes(copies: dict) -> int:
    return sum(t.numel() * t.element_size() for t in copies.values())


def in_place_problems(sglang_model: torch.nn.Module) -> list[str]:
    """Why a parameter chosen at load to be read in place cannot be, now that SGLang converted
    its tensors (no copy of it was kept): one reason each; none when all can."""
    theirs = dict(sglang_model.named_parameters())
    ours = None
    reasons = []
    for name, entry in in_place(sglang_model).items():
        if ours is None:
            ours = _meta_model(sglang_model).state_dict()
        why = inplace.mismatch(entry, theirs.get(entry.theirs), ours[name])
        if why is not None:
            reasons.append(f"{entry.theirs}: SGLang's loaded tensor cannot be read as {name}, "
                           f"and no copy was kept at load: {why}")
    return reasons


def _meta_model(sglang_model: torch.nn.Module) -> DeepseekV4Model:
    config, hf = model_config(sglang_model.config), hf_dict(sglang_model.config)
    return DeepseekV4Model(config, device="meta", max_seq_len=1, weights=weight_format(hf),
                           split=rank_split())


def build_model(config: ModelConfig, fmt: str, copies: dict, device: torch.device,
                max_seq_len: int, options: Options, split: TensorSplit,
                sglang_model: torch.nn.Module) -> DeepseekV4Model:
    """This rank's model: the parameters `in_place` serves are SGLang's loaded tensors (checked
    again now that SGLang converted them), the rest filled from the load hook's host copies,
    which are then dropped; what the model holds itself takes their place in ``copies`` (kind
    MODEL)."""
    served = in_place(sglang_model)
    kept = {key: t for key, t in copies.items() if key[0] == CHECKPOINT}
    held = HeldTensors({name: t for (_, name, _, _), t in kept.items()}, WHERE,
                       {name: (shape, part) for (_, name, shape, part) in kept if part})
    if not held.tensors:
        raise ValueError("copies: no checkpoint tensor was kept at load (the load path did not "
                         "pass them through SGLang's monokernel_weights_iterator)")
    model = DeepseekV4Model(config, dtype=torch.bfloat16, device=device, max_seq_len=max_seq_len,
                            options=options, weights=fmt, split=split)
    theirs = dict(sglang_model.named_parameters())
    targets = model.state_dict(keep_vars=True)      # the parameters themselves, to rebind
    for name, entry in served.items():
        why = inplace.mismatch(entry, theirs.get(entry.theirs), targets[name])
        if why is not None:
            raise ValueError(f"{entry.theirs}: SGLang's loaded tensor cannot be read as {name}, "
                             f"and no copy was kept at load: {why}")
    with torch.no_grad():
        for name, entry in served.items():
            inplace.bind(targets[name], entry, theirs[entry.theirs])
    block = loader.fp8_block_size({"quantization_config": None})
    # The whole model's shapes, of the tensors this rank holds: other ranks' experts were not kept.
    held_here = model.state_dict().keys()
    whole = {k: v for k, v in model.whole_model_tensors().items()
             if k in held_here and k not in served}
    loader.fill_from(model, whole, WHERE, held.handles(), held.stored(), block, options)
    for key in [k for k in copies if k[0] == CHECKPOINT]:
        del copies[key]
    for name, t in model.state_dict().items():
        if served.get(name) is None or served[name].how != inplace.VIEW:
            copies[(MODEL, name)] = t
    return model
