"""vLLM plugin: vLLM's DeepSeek-V4 SWA KV insert runs on this backend's set-KV kernel on ROCm.

vLLM's loader (`vllm.plugins.load_general_plugins`, in every engine and worker process) calls
`register()` through the entry point `dsv4_rocm` of the group `vllm.general_plugins`;
`VLLM_PLUGINS` can leave it out and `DSV4_VLLM_PLUGIN=0` turns it off.

What it replaces (vLLM 0.33): `DeepseekV4Attention._fused_qnorm_rope_kv_insert(q, kv, positions,
attn_metadata)`, which the ROCm attention (`DeepseekV4ROCMAiterMLAAttention`) inherits. It is a
plain method, not a CustomOp, so vLLM's out-of-tree op registration (`CustomOp.register_oot`)
cannot reach it; the plugin checks the method's signature in the installed source and wraps it.
vLLM keeps SWA in its own KV group (no full -> SWA translation) and stores it in the V4 layout
inside blocks of `block_size` tokens whose stride is the cache tensor's `stride(0)`. Its insert:
q gets a weightless RMSNorm and RoPE on dims 448..511 in fp32, rounded once, returned as a new
tensor; kv arrives normalized, gets RoPE, is rounded to bf16 and stored (fp8 maximum 224 with
fnuz on gfx942); rows past `slot_mapping`'s length and negative slots write nothing. Our
`fused_k_norm_rope_store` with `weight=None` and `StoreNumerics(q_mode="norm_rope_fp32")` does
the same. Other cache formats (bf16, per-tensor fp8), the profile run (no metadata) and padded
q heads go to vLLM's own code. On an NVIDIA GPU nothing is replaced (vLLM's CUDA kernel stays).
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from hip_kernels import numerics as N
from hip_kernels import DEFAULT_KERNEL_OPTIONS, KernelOptions, set_kv
from hip_kernels.backend import resolve
from hip_kernels.platform import backend as platform_backend
from hip_kernels.platform import Fp8Dialect, default_device

from .. import envs
from .host_signatures import class_methods, installed_version

logger = logging.getLogger(__name__)

MODULE = "vllm.models.deepseek_v4.attention"
CLASS = "DeepseekV4Attention"
ROCM_MODULE = "vllm.models.deepseek_v4.amd.rocm"
ROCM_CLASS = "DeepseekV4ROCMAiterMLAAttention"
METHOD = "_fused_qnorm_rope_kv_insert"
PARAMS = ("self", "q", "kv", "positions", "attn_metadata")
VLLM_FNUZ_MAX = 224.0


@functools.lru_cache(maxsize=None)
def _numerics(dialect_name: str) -> N.StoreNumerics:
    return N.StoreNumerics(fp8_max=VLLM_FNUZ_MAX if dialect_name == "fnuz" else None,
                           q_mode="norm_rope_fp32")


def vllm_numerics(dialect: Fp8Dialect) -> N.StoreNumerics:
    """What vLLM 0.33's own insert kernel computes in the FP8 `dialect` (see the module
    docstring)."""
    return _numerics(dialect.name)


_FREQS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def freqs_cis_of(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """complex64 [max_pos, 32] from vLLM's float32 [max_pos, 64] cache (cos then sin halves),
    made once per cache tensor (a model has one or two: plain and YaRN RoPE)."""
    key = (cos_sin_cache.data_ptr(), cos_sin_cache._version, tuple(cos_sin_cache.shape),
           cos_sin_cache.device)
    hit = _FREQS.get(key)
    if hit is None:
        half = cos_sin_cache.shape[1] // 2
        freqs = torch.complex(cos_sin_cache[:, :half].float(), cos_sin_cache[:, half:].float())
        if len(_FREQS) >= 8:
            _FREQS.clear()
        hit = _FREQS[key] = (cos_sin_cache, freqs)   # holds the source: its address stays its own
    return hit[1]


def insert_hook(original, kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS):
    """The wrapped `_fused_qnorm_rope_kv_insert`: ours for vLLM's fp8 V4 SWA cache, run with
    `kernel` (the kernel flags as the plugin read them at registration)."""

    @functools.wraps(original)
    def insert(self, q, kv, positions, attn_metadata):
        if not isinstance(attn_metadata, dict) or self.padded_heads != self.n_local_heads:
            return original(self, q, kv, positions, attn_metadata)
        swa = attn_metadata.get(self.swa_cache_layer.prefix)
        cache = self.swa_cache_layer.kv_cache
        if swa is None or cache.dtype != torch.uint8:
            return original(self, q, kv, positions, attn_metadata)
        n, rows = swa.slot_mapping.shape[0], q.shape[0]
        loc = swa.slot_mapping
        if rows != n:  # q rows past the slot mapping (padding) are still rotated
            loc = torch.full((rows,), -1, dtype=loc.dtype, device=loc.device)
            loc[:n] = swa.slot_mapping
        q_out = q.clone()
        set_kv.fused_k_norm_rope_store(
            kv, None, self.eps, freqs_cis_of(self.rotary_emb.cos_sin_cache), positions, loc,
            cache.view(cache.shape[0], -1), swa.block_size, q=q_out,
            numerics=vllm_numerics(kernel.fp8_dialect), kernel=kernel)
        return q_out

    insert.__wrapped__ = original
    return insert


def _problem() -> str | None:
    """Why nothing would be replaced in the installed vLLM, or None."""
    if installed_version("vllm") is None:
        return "not installed"
    methods = class_methods(MODULE, CLASS)
    if methods is None:
        return f"{MODULE}.{CLASS} is not in the installed vLLM"
    if methods.get(METHOD) != PARAMS:
        return f"{CLASS}.{METHOD}{methods.get(METHOD)} differs from the expected {PARAMS}"
    if METHOD in (class_methods(ROCM_MODULE, ROCM_CLASS) or {}):
        return f"{ROCM_CLASS} overrides {METHOD}"
    if platform_backend() == "cuda":
        return "an NVIDIA GPU keeps vLLM's own CUDA insert"
    return None


def _target() -> str:
    op = "fused_k_norm_rope_store"
    backend = resolve(op, default_device(), KernelOptions.from_env().backend, hip_ok=False)
    return f"{CLASS}.{METHOD} -> {op} on {backend}"


def status() -> str:
    version = installed_version("vllm")
    if version is None:
        return "vllm: not installed"
    if not envs.VLLM_PLUGIN.get():
        return f"vllm {version}: plugin off (DSV4_VLLM_PLUGIN=0)"
    problem = _problem()
    if problem:
        return f"vllm {version}: nothing would be replaced ({problem})"
    return f"vllm {version}: would replace {_target()}"


def register() -> None:
    """The `vllm.general_plugins` entry point. vLLM does not catch a plugin's exceptions, so a
    failure here is logged and vLLM's own insert stays."""
    try:
        _register()
    except Exception:
        logger.exception("dsv4-rocm: the vLLM plugin failed; vLLM's own KV insert stays")


def _register() -> None:
    if not envs.VLLM_PLUGIN.get():
        logger.info("dsv4-rocm: vLLM plugin off (DSV4_VLLM_PLUGIN=0)")
        return
    problem = _problem()
    if problem:
        logger.warning("dsv4-rocm: vLLM %s not patched: %s", installed_version("vllm"), problem)
        return
    cls = getattr(importlib.import_module(MODULE), CLASS)
    original = cls.__dict__[METHOD]
    if getattr(original, "__wrapped__", None) is not None:
        return  # already installed in this process
    kernel = KernelOptions.from_env()      # the flags, read once, at registration
    setattr(cls, METHOD, insert_hook(original, kernel))
    logger.warning("dsv4-rocm: vLLM %s plugin active (fp8 %s): %s; other SWA cache formats, the "
                   "profile run and padded q heads keep vLLM's insert", installed_version("vllm"),
                   kernel.fp8_dialect.name, _target())
