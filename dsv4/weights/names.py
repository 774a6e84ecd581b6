"""Checkpoint tensor names: the reference inference naming and the Hugging Face variant.

The model's own ``state_dict`` uses the reference names (the ones the published DeepSeek-V4
checkpoints ship with): ``embed.weight``, ``layers.{i}.attn.wq_a.weight`` plus its FP8 block
scale ``layers.{i}.attn.wq_a.scale``, ``layers.{i}.ffn.experts.{j}.w1.weight``, ``mtp.{k}.*`` ...

The Hugging Face variant follows transformers' DeepseekV4 module tree (its checkpoint conversion
mapping for ``deepseek_v4``) with DeepSeek-V3-style per-expert names: a ``model.`` prefix,
``self_attn`` / ``mlp``, ``input_layernorm`` / ``post_attention_layernorm``, ``attn_hc.fn`` ...,
``*_proj`` projections, the compressors and the indexer under ``self_attn.compressor``,
``e_score_correction_bias``, ``lm_head.weight`` and ``weight_scale_inv`` for quantization scales.
"""

from __future__ import annotations

import re

# Whole-parameter renames inside a layer: reference -> Hugging Face.
_LAYER_PARAMS = {
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
}

# Module renames inside a layer (their ``.weight`` and, when quantized, their scale).
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.q_norm": "self_attn.q_a_norm",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.kv_norm": "self_attn.kv_norm",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.compressor.norm": "self_attn.compressor.kv_norm",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.weights_proj",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.compressor.norm": "self_attn.compressor.indexer.kv_norm",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
}
_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}

# Top-level names: reference -> Hugging Face (without the ``model.`` prefix unless shown).
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# Older transformers revisions nested the indexer's weights_proj one level deeper.
_HF_ALIASES = {
    "self_attn.compressor.indexer.scorer.weights_proj": "self_attn.compressor.indexer.weights_proj",
}

REF_SCALE = "scale"
HF_SCALE = "weight_scale_inv"
# Scale suffixes accepted on load; "weight_scale" is vLLM's name for MXFP4 expert scales.
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".scale")

_HF_LAYER_PARAMS = {v: k for k, v in _LAYER_PARAMS.items()}
_HF_LAYER_MODULES = {v: k for k, v in _LAYER_MODULES.items()}
_HF_EXPERT_PROJ = {v: k for k, v in _EXPERT_PROJ.items()}
_HF_TOP = {v: k for k, v in _TOP.items()}

_LAYER_RE = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_REF_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])$")
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)$")


def to_reference(name: str) -> tuple[str, bool]:
    """Map a checkpoint name (either naming) to ``(reference name, is_scale)``.

    A quantization scale maps to the name of the weight it scales, with ``is_scale`` set. Names
    that follow neither naming come back unchanged (they are reported as unexpected later).
    """
    if name in _HF_TOP:
        return _HF_TOP[name], False
    if name.startswith("model."):
        return _hf_to_reference(name[len("model."):])
    return _ref_to_reference(name)


def _ref_to_reference(name: str) -> tuple[str, bool]:
    if name in _TOP:
        return name, False
    m = _LAYER_RE.match(name)
    if m is not None:
        rest = m.group(3)
        if rest in _LAYER_PARAMS:
            return name, False
    if name.endswith("." + REF_SCALE):
        return name[: -len(REF_SCALE)] + "weight", True
    return name, False


def _hf_to_reference(name: str) -> tuple[str, bool]:
    m = _LAYER_RE.match(name)
    if m is None:
        return "model." + name, False
    kind, idx, rest = m.groups()
    prefix = f"{kind}.{idx}."
    if rest in _HF_LAYER_PARAMS:
        return prefix + _HF_LAYER_PARAMS[rest], False
    module, leaf, is_scale = _split_leaf(rest)
    ref_module = _hf_module_to_reference(module)
    if ref_module is None or leaf is None:
        return prefix + rest, is_scale
    return prefix + ref_module + ".weight", is_scale


def _split_leaf(rest: str) -> tuple[str, str | None, bool]:
    for suffix in _SCALE_SUFFIXES:
        if rest.endswith(suffix):
            return rest[: -len(suffix)], "weight", True
    if rest.endswith(".weight"):
        return rest[: -len(".weight")], "weight", False
    return rest, None, False


def _hf_module_to_reference(module: str) -> str | None:
    module = _HF_ALIASES.get(module, module)
    if module in _HF_LAYER_MODULES:
        return _HF_LAYER_MODULES[module]
    m = _HF_EXPERT_RE.match(module)
    if m is not None:
        return f"ffn.experts.{m.group(1)}.{_HF_EXPERT_PROJ[m.group(2)]}"
    return None


def to_hf(name: str) -> str:
    """Map a reference parameter name to its Hugging Face name (MTP layers under ``model.mtp``)."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.match(name)
    if m is None:
        raise KeyError(f"no Hugging Face name for {name!r}")
    kind, idx, rest = m.groups()
    prefix = f"model.{kind}.{idx}."
    if rest in _LAYER_PARAMS:
        return prefix + _LAYER_PARAMS[rest]
    if rest.endswith(".weight"):
        module = rest[: -len(".weight")]
        if module in _LAYER_MODULES:
            return prefix + _LAYER_MODULES[module] + ".weight"
        e = _REF_EXPERT_RE.match(module)
        if e is not None:
            return prefix + f"mlp.experts.{e.group(1)}.{_EXPERT_PROJ[e.group(2)]}.weight"
    raise KeyError(f"no Hugging Face name for {name!r}")


def scale_name(weight_name: str, naming: str) -> str:
    """Name of the quantization scale stored next to ``weight_name`` (given in that naming)."""
    base = weight_name[: -len("weight")]
    return base + (REF_SCALE if naming == "reference" else HF_SCALE)


def is_mtp(ref_name: str, n_layers: int) -> bool:
    """MTP tensors: ``mtp.*`` or, as in DeepSeek-V3-style checkpoints, layers past n_layers."""
    m = _LAYER_RE.match(ref_name)
    if m is None:
        return False
    return m.group(1) == "mtp" or int(m.group(2)) >= n_layers
