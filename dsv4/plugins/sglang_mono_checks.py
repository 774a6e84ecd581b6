"""What the SGLang monokernel spec refuses, with the reasons SGLang lists when it stops a server.

`config_disable_reasons(cfg, hf_config)` runs while SGLang resolves its server arguments (before
any weight is read): the model config this project's layers cannot run, and the server settings
`Requirements` cannot state. `model_disable_reasons(model, hf_config, copies)` runs after the
weights loaded, on every TP rank (SGLang gathers every rank's reasons before anything is built):
the weight format, the parameters to be read in place as SGLang converted them, and whether the
model this project holds fits beside SGLang's weights.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers.quant_linear import fp8_weight_dtype
from ..memory_estimate import available_bytes
from ..parallel.split import split_problem
from ..weights.formats import native_problem
from .sglang_mono_config import hf_dict, model_config
from .sglang_mono_inplace import FNUZ
from .sglang_mono_weights import (copy_bytes, in_place_problems, max_seq_len, model_bytes,
                                  rank_split, weight_format)

# DeepSeek-V4.1 / vision fields of SGLang's DeepSeekV4Config this model does not have, with the
# value that means "not used".
UNUSED_FIELDS = {
    "kv_source_layer_ids": [],
    "index_source_layer_ids": [],
    "engram_layer_ids": [],
    "vision_n_layers": 0,
    "candidate_topk_blocks": 0,
    "hc_pre_from_prev_sublayer": False,
}
# SGLang's page sizes the pool's compressed caches divide into whole rows (page_size / 128 >= 1).
PAGE_SIZE_MULTIPLE = 128


def config_disable_reasons(cfg: Any, hf_config: Any) -> list[str]:
    """Reasons, before load, that this spec cannot serve the model SGLang is configured for."""
    reasons = []
    d = hf_dict(hf_config)
    for name, unused in UNUSED_FIELDS.items():
        if d.get(name, unused) not in (unused, None):
            reasons.append(f"config.{name}={d[name]!r}: this model has no such part "
                           f"(only {unused!r} is supported)")
    try:
        config = model_config(hf_config)
    except ValueError as e:
        return reasons + [f"the model config: {e}"]
    tp = int(getattr(cfg, "tp_size", 1) or 1)
    problem = split_problem(config, tp, native=weight_format(d) == "native")
    if problem:
        reasons.append(problem)
    total = device_total_bytes()
    if total is not None:
        fmt = weight_format(d) or "native"
        seq = max_seq_len(d, config)
        theirs = model_bytes(config, fmt, tp, seq)     # SGLang's weights: about as many bytes
        ours = copy_bytes(config, fmt, tp, seq, fnuz=fp8_weight_dtype() == FNUZ)
        if theirs + ours > total:
            reasons.append(f"this project's model holds {ours / 2**30:.1f} GiB a rank beside "
                           f"SGLang's own weights (about {theirs / 2**30:.1f} GiB): "
                           f"{(theirs + ours) / 2**30:.1f} GiB is more than the device's "
                           f"{total / 2**30:.1f} GiB (use a larger --tp)")
    page = getattr(cfg, "page_size", None)
    if page is not None and page % PAGE_SIZE_MULTIPLE:
        reasons.append(f"--page-size {page} is not a multiple of {PAGE_SIZE_MULTIPLE} (a page "
                       "must hold whole C128 rows)")
    return reasons + server_reasons(cfg)


# Server settings whose pool or outputs the forward does not serve: (argument, its value that
# is refused or None for any truthy value, why).
REFUSED_SERVER_ARGS = (
    ("dsv4_attn_backend", "trtllm", "its uniform FP8 pages are not the V4 layout"),
    ("enable_encoder_swa_bounded_replay", None, "its SWA KV lives in a request window"),
    ("enable_return_hidden_states", None, "the forward returns logits only"),
    ("enable_return_aux_hidden_states", None, "the forward returns logits only"),
)


def server_reasons(cfg: Any) -> list[str]:
    """The server arguments and SGLang environment variables this forward cannot serve."""
    reasons = []
    for arg, refused, why in REFUSED_SERVER_ARGS:
        value = getattr(cfg, arg, None)
        if (value == refused) if refused is not None else bool(value):
            flag = "--" + arg.replace("_", "-")
            reasons.append(f"{flag}" + (f" {value}" if refused is not None else "")
                           + f" is not supported: {why}")
    from sglang.srt.environ import envs

    backend = envs.SGLANG_HACK_FLASHMLA_BACKEND.get()
    if "unified" in str(backend).lower():
        reasons.append(f"SGLANG_HACK_FLASHMLA_BACKEND={backend} is not supported: the unified "
                       "KV layout is not the V4 layout")
    return reasons


def model_disable_reasons(model: torch.nn.Module, hf_config: Any, copies: dict) -> list[str]:
    """Reasons, after load, on this rank: the weight format, and whether the copies fit."""
    reasons = []
    d = hf_dict(hf_config)
    fmt = weight_format(d)
    if fmt is None:
        reasons.append(f"quantization_config {d.get('quantization_config')!r} is neither the "
                       "published DeepSeek-V4 format (FP8 e4m3 in 128x128 blocks with ue8m0 "
                       "scales, FP4 experts) nor none (bf16 weights)")
    elif fmt == "native":
        problem = native_problem(model_config(hf_config))
        if problem:
            reasons.append(problem)
    reasons += in_place_problems(model)
    free = free_device_bytes()
    if free is not None and fmt is not None:
        config = model_config(hf_config)
        ours = copy_bytes(config, fmt, rank_split().size, max_seq_len(d, config),
                          fnuz=fp8_weight_dtype() == FNUZ)
        if ours > free:
            reasons.append(f"this project's model holds {ours / 2**30:.2f} GiB a rank, more "
                           f"than the {free / 2**30:.2f} GiB this device has free after "
                           "SGLang's weights loaded (use a larger --tp)")
    return reasons


def device_total_bytes() -> int | None:
    """Memory of the current GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    return available_bytes(torch.device("cuda", torch.cuda.current_device()))


def free_device_bytes() -> int | None:
    """Free memory of the current GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info()[0]
