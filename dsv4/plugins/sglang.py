"""SGLang plugin: SGLang's DeepSeek-V4 SWA KV writes run on this backend's set-KV kernels.

SGLang's loader (`sglang.srt.plugins.load_plugins`, first thing in every scheduler/TP worker
process) calls `register()` through the entry point `dsv4_rocm` of the group
`sglang.srt.plugins`; `SGLANG_PLUGINS` can leave it out and `DSV4_SGLANG_PLUGIN=0` turns it off.
`register()` checks the installed pool's method signatures, then registers AROUND hooks with
SGLang's `HookRegistry` (applied by the loader right after the plugins ran) on:

- `DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused(layer_id, swa_loc, cache_k)`: our
  `fused_store_cache` into `get_swa_raw_buffer(layer_id)`;
- `DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope(layer_id, swa_loc, kv,
  kv_weight, eps, freqs_cis, positions, q=None)`: our `fused_k_norm_rope_store`;
- where the installed SGLang has it (the 0.5.12 line), `get_cached_swa_loc(raw_loc, layer_id)`:
  our identity-keyed translation cache instead of its "layer_id == start_layer" rule.

The stores write SGLang's own buffers in SGLang's V4 layout (the same bytes as ours: 576-byte
value rows, then 8-byte scale rows, page stride a multiple of 576) with SGLang's numerics on ROCm
(`StoreNumerics` below). A pool that is not a plain paged V4 pool (request window, uniform FP8,
unified KV, another layout) keeps SGLang's setters, said once per pool in the log. SGLang's loader
swallows a plugin's exceptions, so failures here are logged loudly by the plugin itself.
"""

from __future__ import annotations

import functools
import logging

from hip_kernels import numerics as N
from hip_kernels import DEFAULT_KERNEL_OPTIONS, KernelOptions, set_kv
from hip_kernels.backend import resolve
from hip_kernels.platform import Fp8Dialect, default_device

from .. import envs
from .host_signatures import class_methods, installed_version
from .sglang_pool_kind import not_plain_v4_pool
from .swa_loc_adapter import cached_swa_loc_hook

logger = logging.getLogger(__name__)

POOL_MODULE = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
POOL_CLASS = "DeepSeekV4TokenToKVPool"
POOL = f"{POOL_MODULE}.{POOL_CLASS}"
# The fnuz maximum SGLang's fused norm+RoPE kernel clamps to on gfx942 (its kFP8E4M3Max).
SGLANG_FNUZ_MAX = 224.0


@functools.lru_cache(maxsize=None)
def _numerics(op: str, dialect_name: str) -> N.StoreNumerics:
    if op == "fused_k_norm_rope_store":
        # fp32 through the norm and the RoPE, fp32 quantized, q only rotated (fma-rounded).
        fnuz_max = SGLANG_FNUZ_MAX if dialect_name == "fnuz" else None
        return N.StoreNumerics(round_to_bf16=False, fp8_max=fnuz_max, q_mode="rope_only")
    # SGLang's ROCm Triton store: the dtype's own maximum, tile amax floored at 1e-8.
    return N.StoreNumerics(amax_floor=1e-8)


def sglang_numerics(op: str, dialect: Fp8Dialect) -> N.StoreNumerics:
    """The StoreNumerics that reproduce what SGLang 0.5.23's own ROCm kernel writes for `op` in
    the FP8 `dialect`."""
    return _numerics(op, dialect.name)


def _ours(pool) -> bool:
    decided = pool.__dict__.get("_dsv4_rocm_setters")
    if decided is None:
        reason = not_plain_v4_pool(pool)
        if reason:
            logger.warning("dsv4-rocm: this %s keeps SGLang's own SWA setters: %s",
                           POOL_CLASS, reason)
        decided = pool.__dict__["_dsv4_rocm_setters"] = reason is None
    return decided


def fused_store_hook(original, self, layer_id, swa_loc, cache_k, *,
                     kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS):
    if not _ours(self):
        return original(self, layer_id, swa_loc, cache_k)
    set_kv.fused_store_cache(cache_k, self.get_swa_raw_buffer(layer_id), swa_loc,
                             self.swa_page_size,
                             numerics=sglang_numerics("fused_store_cache", kernel.fp8_dialect),
                             kernel=kernel)


def fused_norm_rope_hook(original, self, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis,
                         positions, q=None, *, kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS):
    if not _ours(self):
        return original(self, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions, q)
    set_kv.fused_k_norm_rope_store(kv, kv_weight, eps, freqs_cis, positions, swa_loc,
                                   self.get_swa_raw_buffer(layer_id), self.swa_page_size, q=q,
                                   numerics=sglang_numerics("fused_k_norm_rope_store",
                                                            kernel.fp8_dialect),
                                   kernel=kernel)


# method -> (the parameters this plugin was written against, hook, our op or None)
REPLACEMENTS = {
    "set_swa_key_buffer_radix_fused": (
        ("self", "layer_id", "swa_loc", "cache_k"), fused_store_hook, "fused_store_cache"),
    "set_swa_key_buffer_radix_fused_norm_rope": (
        ("self", "layer_id", "swa_loc", "kv", "kv_weight", "eps", "freqs_cis", "positions", "q"),
        fused_norm_rope_hook, "fused_k_norm_rope_store"),
}
# Feature-detected: only SGLang versions that translate with the start_layer rule have it.
LEGACY = {"get_cached_swa_loc": (("self", "raw_loc", "layer_id"), cached_swa_loc_hook, None)}


def plan(methods: dict[str, tuple[str, ...]] | None) -> tuple[dict, str | None]:
    """({method: (params, hook, op)} to replace, None) or ({}, why nothing is replaced)."""
    if methods is None:
        return {}, f"{POOL} is not installed"
    chosen = {}
    for name, entry in {**REPLACEMENTS, **LEGACY}.items():
        params = entry[0]
        if name not in methods:
            if name in REPLACEMENTS:
                return {}, f"{POOL_CLASS}.{name} is missing"
            continue
        if methods[name] != params:
            return {}, (f"{POOL_CLASS}.{name}{methods[name]} differs from the expected "
                        f"{params}")
        chosen[name] = entry
    return chosen, None


def describe_plan(chosen: dict) -> str:
    """'method (op on backend), ...' for the activation line and `python -m dsv4 env`."""
    device, kernel = default_device(), KernelOptions.from_env()
    parts = []
    for name, (_, _, op) in chosen.items():
        hip_ok = op is not None and sglang_numerics(op, kernel.fp8_dialect).is_default
        where = "identity-keyed SWA location cache" if op is None else (
            f"{op} on {resolve(op, device, kernel.backend, hip_ok=hip_ok)}")
        parts.append(f"{POOL_CLASS}.{name} -> {where}")
    return "; ".join(parts)


def status() -> str:
    """One line: what the plugin would do with the installed SGLang (for `python -m dsv4 env`)."""
    version = installed_version("sglang")
    if version is None:
        return "sglang: not installed"
    if not envs.SGLANG_PLUGIN.get():
        return f"sglang {version}: plugin off (DSV4_SGLANG_PLUGIN=0)"
    chosen, problem = plan(class_methods(POOL_MODULE, POOL_CLASS))
    if problem:
        return f"sglang {version}: nothing would be replaced ({problem})"
    return f"sglang {version}: would replace {describe_plan(chosen)}"


def monokernel_status() -> list[str]:
    """What the monokernel spec would cover with the installed SGLang, or why it would not be
    registered (for `python -m dsv4 env`)."""
    version = installed_version("sglang")
    if version is None:
        return ["sglang monokernel: SGLang not installed"]
    if not envs.SGLANG_PLUGIN.get():
        return [f"sglang {version} monokernel: off (DSV4_SGLANG_PLUGIN=0)"]
    if not envs.SGLANG_MONOKERNEL.get():
        return [f"sglang {version} monokernel: off (DSV4_SGLANG_MONOKERNEL=0)"]
    from . import sglang_monokernel

    try:
        return sglang_monokernel.coverage()
    except Exception as e:    # SGLang lacks the contract, or its types changed
        return [f"sglang {version} monokernel: no usable AMD monokernel contract "
                f"({type(e).__name__}: {e})"]


def register() -> None:
    """The `sglang.srt.plugins` entry point (zero arguments, called by SGLang's loader)."""
    try:
        _register()
    except Exception:
        logger.exception("dsv4-rocm: the SGLang plugin failed; SGLang's own KV setters stay")
        raise


def _register() -> None:
    if not envs.SGLANG_PLUGIN.get():
        logger.info("dsv4-rocm: SGLang plugin off (DSV4_SGLANG_PLUGIN=0)")
        return
    _register_setters()
    _register_monokernel()


def _register_monokernel() -> None:
    """Register the monokernel spec (`sglang_monokernel.py`); one log line says what happened.
    A SGLang without the AMD monokernel contract, or with another version of it, keeps its
    standard path."""
    if not envs.SGLANG_MONOKERNEL.get():
        logger.info("dsv4-rocm: monokernel spec not registered (DSV4_SGLANG_MONOKERNEL=0)")
        return
    from . import sglang_monokernel

    logger.warning("dsv4-rocm: %s", sglang_monokernel.register_spec())


def _register_setters() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    chosen, problem = plan(class_methods(POOL_MODULE, POOL_CLASS))
    if problem:
        logger.warning("dsv4-rocm: SGLang %s not patched: %s", installed_version("sglang"),
                       problem)
        return
    kernel = KernelOptions.from_env()      # the flags, read once, when SGLang loads the plugin
    for name, (_, hook, op) in chosen.items():
        bound = hook if op is None else functools.partial(hook, kernel=kernel)
        HookRegistry.register(f"{POOL}.{name}", bound, HookType.AROUND)
    logger.warning("dsv4-rocm: SGLang %s plugin active (fp8 %s): %s; request-window, uniform-FP8 "
                   "and unified-KV pools keep SGLang's setters", installed_version("sglang"),
                   kernel.fp8_dialect.name, describe_plan(chosen))
