"""The monokernel's weights: checkpoint tensors seen at load, this project's model built from them.

SGLang's loader passes each checkpoint tensor through the spec's `load_tensor(copies, model,
name, tensor)` before converting it (`monokernel_weights_iterator`). `load_tensor` keeps, in host
memory, the tensors this TP rank's part of the model reads: every non-MTP tensor but other ranks'
routed experts. `build_model` then builds this project's `DeepseekV4Model` on the device from
them with the checkpoint loader (`dsv4.weights.loader.fill_from`: every name and shape checked
first, FP8 made fnuz exactly on gfx942, the rank's slices), and the host copies are dropped. What
stays is the model's own weights on the device: `copies` lists them under `MODEL`, so SGLang's log
line and `python -m dsv4 env` state the bytes. They are a second copy of the weights: SGLang's
post-load layouts are not read in place yet (docs/plugins.md says which could be).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..config import ModelConfig
from ..memory_estimate import weight_bytes
from ..model import DeepseekV4Model
from ..options import Options
from ..parallel import SINGLE, TensorSplit
from ..parallel.shards import expert_of
from ..weights import loader
from ..weights.held import HeldTensors
from ..weights.names import is_mtp, to_reference

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


def rank_split(hf_config: Any = None) -> TensorSplit:
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


def load_tensor(copies: dict, model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Keep a host copy of a checkpoint tensor this rank's model reads (the spec's load hook)."""
    config = model.config
    ref, _ = to_reference(name)
    if is_mtp(ref, config.num_hidden_layers):
        return
    if not _owns(rank_split(), ref, config.n_routed_experts):
        return
    copies[(CHECKPOINT, name)] = tensor.detach().to("cpu", copy=True)


def max_seq_len(hf: dict, config: ModelConfig) -> int:
    """The positions the model's RoPE tables hold: the config's max_position_embeddings."""
    return int(hf.get("max_position_embeddings") or config.original_seq_len)


def copy_bytes(config: ModelConfig, fmt: str, tp: int, seq_len: int) -> int:
    """Device bytes of this project's model on one of ``tp`` ranks: what the monokernel holds
    beside SGLang's own weights."""
    return weight_bytes(config, fmt, max_seq_len=seq_len, tp=tp)


def copied_bytes(copies: dict) -> int:
    return sum(t.numel() * t.element_size() for t in copies.values())


def build_model(config: ModelConfig, fmt: str, copies: dict, device: torch.device,
                max_seq_len: int, options: Options, split: TensorSplit) -> DeepseekV4Model:
    """This rank's model, filled from the load hook's host copies, which are then dropped; the
    model's tensors take their place in ``copies`` (kind MODEL)."""
    held = HeldTensors({name: t for (kind, name), t in copies.items() if kind == CHECKPOINT},
                       WHERE)
    if not held.tensors:
        raise ValueError("copies: no checkpoint tensor was kept at load (the load path did not "
                         "pass them through SGLang's monokernel_weights_iterator)")
    model = DeepseekV4Model(config, dtype=torch.bfloat16, device=device, max_seq_len=max_seq_len,
                            options=options, weights=fmt, split=split)
    block = loader.fp8_block_size({"quantization_config": None})
    loader.fill_from(model, model.whole_model_tensors(), WHERE, held.handles(), held.stored(),
                     block, options)
    for key in [k for k in copies if k[0] == CHECKPOINT]:
        del copies[key]
    for name, t in model.state_dict().items():
        copies[(MODEL, name)] = t
    return model
