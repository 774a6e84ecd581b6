"""DeepSeek-V4 model configuration: reference inference field names, Hugging Face aliases, presets.

The field names are those of the reference inference code's ``ModelArgs`` (``dim``, ``n_layers``,
...). ``from_dict`` also accepts the Hugging Face ``config.json`` names (``hidden_size``,
``num_hidden_layers``, ``rope_scaling: {factor, ...}``, ...). ``validate`` raises a ValueError that
names the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The KV cache layout (448 fp8 + 64 bf16 per row) and the indexer Hadamard size fix these.
HEAD_DIM = 512
ROPE_HEAD_DIM = 64
INDEX_HEAD_DIM = 128
COMPRESS_RATIOS = (0, 4, 128)
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")

# Hugging Face config.json name -> reference name.
HF_ALIASES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "sliding_window": "window_size",
    "num_experts_per_tok": "n_activated_experts",
    "num_hash_layers": "n_hash_layers",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "moe_intermediate_size": "moe_inter_dim",
    "rms_norm_eps": "norm_eps",
    "num_nextn_predict_layers": "n_mtp_layers",
}
# Where a Hugging Face config keeps YaRN's parameters: rope_scaling in config.json, rope_parameters
# in a transformers (>= 5) config object.
ROPE_SCALING_KEYS = ("rope_scaling", "rope_parameters")
# rope_scaling sub-keys (Hugging Face) -> reference name.
HF_ROPE_SCALING = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "original_seq_len",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
}
# Named when a config holds none of the model's keys (reference name or Hugging Face alias).
EXPECTED_KEYS = ("dim or hidden_size", "n_layers or num_hidden_layers",
                 "n_heads or num_attention_heads", "vocab_size", "compress_ratios")
# Keys that appear in published configs and do not change the math this package implements.
KNOWN_EXTRA_KEYS = frozenset({
    "architectures", "attention_bias", "attention_dropout", "expert_dtype", "hidden_act",
    "initializer_range", "max_position_embeddings", "model_type", "norm_topk_prob",
    "quantization_config", "tie_word_embeddings", "topk_method", "torch_dtype",
    "transformers_version", "use_cache", "max_batch_size", "max_seq_len", "dtype", "scale_fmt",
    "scale_dtype", "num_key_value_heads", "auto_map", "qk_nope_head_dim", "v_head_dim",
})


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    q_lora_rank: int = 1024
    head_dim: int = HEAD_DIM
    rope_head_dim: int = ROPE_HEAD_DIM
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # One ratio per layer, optionally followed by one per MTP layer.
    compress_ratios: tuple[int, ...] = field(default_factory=lambda: _flash_ratios())
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 64
    index_head_dim: int = INDEX_HEAD_DIM
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    n_hash_layers: int = 3
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    moe_inter_dim: int = 2048
    norm_eps: float = 1e-6
    n_mtp_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1

    def __post_init__(self) -> None:
        self.compress_ratios = tuple(int(r) for r in self.compress_ratios)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "ModelConfig":
        """Build from reference or Hugging Face names; unknown keys are logged as a warning and
        ignored. A dict holding no model key at all is refused: ``source`` (the file) names it."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not any(key in ROPE_SCALING_KEYS or HF_ALIASES.get(key, key) in names for key in d):
            raise ValueError(f"{source}: no DeepSeek-V4 model key in it (expected keys such as "
                             f"{', '.join(EXPECTED_KEYS)}); found: "
                             f"{', '.join(sorted(d)) or 'nothing'}")
        values: dict[str, Any] = {}
        unknown = []
        for key, value in d.items():
            if key in ROPE_SCALING_KEYS:
                values.update(_rope_scaling(value))
                continue
            name = HF_ALIASES.get(key, key)
            if name in names:
                if name in values and values[name] != value:
                    raise ValueError(f"config gives {name} twice with different values "
                                     f"({values[name]!r} and {key}={value!r})")
                values[name] = value
            elif key not in KNOWN_EXTRA_KEYS:
                unknown.append(key)
        if unknown:
            logger.warning("%s: ignoring unknown config keys: %s", source,
                           ", ".join(sorted(unknown)))
        kv_heads = d.get("num_key_value_heads", 1)
        if kv_heads != 1:
            raise ValueError(f"num_key_value_heads must be 1 (MQA, K = V), got {kv_heads}")
        if isinstance(values.get("eos_token_id"), list):
            values["eos_token_id"] = values["eos_token_id"][0]
        cfg = cls(**values)
        cfg.validate()
        for key, want in (("qk_nope_head_dim", cfg.head_dim - cfg.rope_head_dim),
                          ("v_head_dim", cfg.head_dim)):
            if key in d and d[key] != want:
                raise ValueError(f"{source}: {key} must be {want} (head_dim={cfg.head_dim}, "
                                 f"rope_head_dim={cfg.rope_head_dim}), got {d[key]!r}")
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object of model keys, got "
                             f"{type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        return d

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        try:
            make = _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}") from None
        cfg = make()
        cfg.validate()
        return cfg

    # ---- derived ------------------------------------------------------------------------------

    def layer_ratio(self, layer_id: int) -> int:
        """Compress ratio of a layer (0 = sliding window only, 4 = CSA, 128 = HCA)."""
        return self.compress_ratios[layer_id]

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.n_hash_layers

    # ---- checks -------------------------------------------------------------------------------

    def validate(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"ModelConfig.{name}: {msg} (got {getattr(self, name)!r})")

        for name in ("vocab_size", "dim", "n_layers", "n_heads", "q_lora_rank", "o_groups",
                     "o_lora_rank", "window_size", "index_n_heads", "index_topk", "hc_mult",
                     "hc_sinkhorn_iters", "n_routed_experts", "n_activated_experts",
                     "moe_inter_dim"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name,
                 "must be a positive integer")
        need(self.head_dim == HEAD_DIM, "head_dim",
             f"must be {HEAD_DIM}: the KV cache row is 448 fp8 + 64 bf16")
        need(self.rope_head_dim == ROPE_HEAD_DIM, "rope_head_dim", f"must be {ROPE_HEAD_DIM}")
        need(self.index_head_dim == INDEX_HEAD_DIM, "index_head_dim",
             f"must be {INDEX_HEAD_DIM} (indexer cache row and Hadamard size)")
        need(self.n_heads % self.o_groups == 0, "o_groups",
             f"must divide n_heads={self.n_heads}")
        need(self.n_mtp_layers >= 0, "n_mtp_layers", "must be >= 0")
        need(len(self.compress_ratios) in (self.n_layers, self.n_layers + self.n_mtp_layers),
             "compress_ratios", f"needs one entry per layer: n_layers={self.n_layers} "
             f"(+ n_mtp_layers={self.n_mtp_layers}) entries, got {len(self.compress_ratios)}")
        bad = sorted({r for r in self.compress_ratios if r not in COMPRESS_RATIOS})
        need(not bad, "compress_ratios", f"entries must be in {COMPRESS_RATIOS}, found {bad}")
        need(self.n_activated_experts <= self.n_routed_experts, "n_activated_experts",
             f"must be <= n_routed_experts={self.n_routed_experts}")
        need(self.n_shared_experts in (0, 1), "n_shared_experts", "must be 0 or 1")
        need(0 <= self.n_hash_layers <= self.n_layers, "n_hash_layers",
             f"must be in 0..n_layers={self.n_layers}")
        need(self.score_func in SCORE_FUNCS, "score_func", f"must be one of {SCORE_FUNCS}")
        for name in ("norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "rope_factor"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.swiglu_limit >= 0, "swiglu_limit", "must be >= 0 (0 = no clamp)")
        need(self.original_seq_len >= 0, "original_seq_len", "must be >= 0 (0 = no YaRN)")


def _rope_scaling(rs: dict[str, Any] | None) -> dict[str, Any]:
    if not rs:
        return {}
    kind = rs.get("type", rs.get("rope_type", "yarn"))
    if kind != "yarn":
        raise ValueError(f"rope_scaling.type must be 'yarn', got {kind!r}")
    return {ref: rs[hf] for hf, ref in HF_ROPE_SCALING.items() if hf in rs}


def _flash_ratios() -> tuple[int, ...]:
    # 43 layers + 1 MTP: 0, 0, then 4/128 alternating (layers 2..42), MTP 0.
    return (0, 0) + (4, 128) * 20 + (4, 0)


def _pro_ratios() -> tuple[int, ...]:
    # 61 layers + 1 MTP: 128, 128, then 4/128 alternating (layers 2..60), MTP 0.
    return (128, 128) + (4, 128) * 29 + (4, 0)


def _flash() -> ModelConfig:
    return ModelConfig()


def _pro() -> ModelConfig:
    return ModelConfig(
        dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
        compress_ratios=_pro_ratios(), index_topk=1024, n_routed_experts=384,
        moe_inter_dim=3072, route_scale=2.5)


def _tiny() -> ModelConfig:
    # Small everywhere except what the cache layout fixes (head 512 = 448 + 64, indexer 128) and
    # the real window: one layer of each ratio (plus a second CSA layer), one hash-routed MoE
    # layer, and an index_topk small enough that selection happens at test lengths.
    return ModelConfig(
        vocab_size=512, dim=64, n_layers=4, n_heads=4, q_lora_rank=32, o_groups=2,
        o_lora_rank=32, window_size=128, compress_ratios=(0, 4, 128, 4), index_n_heads=8,
        index_topk=8, n_routed_experts=8, n_activated_experts=2, n_hash_layers=1,
        moe_inter_dim=32, n_mtp_layers=0)


def _small() -> ModelConfig:
    # The tiny preset widened so that every FP8/FP4 linear's input dim is a multiple of 128 (the
    # reference's act_quant asserts it): the smallest config that runs the published formats.
    # 4 output groups of rank 128 (wo_b's 512 inputs in 128-wide FP8 blocks) so that it splits
    # over 2 and 4 tensor-parallel ranks, as do its 4 heads, 8 index heads, 8 experts and vocab.
    return dataclasses.replace(_tiny(), dim=256, q_lora_rank=128, moe_inter_dim=128, o_groups=4,
                               o_lora_rank=128)


_PRESETS = {"flash": _flash, "pro": _pro, "tiny": _tiny, "small": _small}
