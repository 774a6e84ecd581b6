"""The SGLang monokernel spec: `--enable-amd-monokernel` runs DeepSeek-V4's decode steps on this
project's model, inside SGLang 0.5.23, over SGLang's own KV pool.

SGLang's AMD monokernel contract (`sglang.kernels.plugin_kernels.amd.spec`, API version 1) lets a
library register a frozen `MonoSpec` per architecture; with the flag on, SGLang validates it
while resolving the server arguments and again after the weights load, then replaces the model's
forward for the decode batch sizes the spec covers (`sglang.srt.kernel_plugins.amd.binding`).
`register_spec()` (called by `dsv4.plugins.sglang.register`, the `dsv4_rocm` entry point)
registers `SPEC` below; `DSV4_SGLANG_MONOKERNEL=0` or `DSV4_SGLANG_PLUGIN=0` leaves it out.
SGLang is optional: its contract is imported when the spec is first made (`make_spec`, behind
the module attribute `SPEC` that SGLang's registry reads), never when this module is imported.

What the spec states, and why:
- widths: the decode batch sizes this project's graphs capture (1 to 64, each one); TP sizes:
  the tensor-parallel degrees its split runs (1, 2, 4, 8; `config_disable_reasons` names a model
  whose heads or experts do not divide). resident_blocks 1: no kernel here keeps a persistent
  grid, so any number of compute units runs it.
- features: none. Every feature SGLang refuses by default stays refused (DP attention,
  speculative decoding, expert parallelism, ...): the forward runs plain decode steps.
- requires: bf16 activations, SGLang's `dsv4` decode attention backend, an FP8 KV cache with
  FP8 (not FP4) indexer keys, and the V4 head geometry its kernels and KV layout are built for.
  The indexer keys may lie row by row or in SGLang's 16 x 16 tiles (its ROCm default with
  aiter): the pool view reads SGLang's choice and the model's indexer kernels read and write
  either order.
- numerics: TOLERANCE. The forward gives the reference implementation's bits; SGLang's own path
  rounds differently, and the two were never compared on a GPU (see docs/plugins.md).
"""

from __future__ import annotations

import functools
import logging

from .host_signatures import installed_version
from .sglang_mono_checks import config_disable_reasons, model_disable_reasons
from .sglang_mono_forward import build
from .sglang_mono_weights import load_tensor

logger = logging.getLogger(__name__)

ARCHITECTURE = "DeepseekV4ForCausalLM"
SPEC_PATH = f"{__name__}:SPEC"
# The contract version this module is written against (SGLang 0.5.23's).
API_VERSION = 1
WIDTHS = tuple(range(1, 65))
TP_SIZES = (1, 2, 4, 8)
ISAS = ("gfx942", "gfx950")
# What SGLang's Requirements state (make_spec): its server arguments and HF config values.
SERVER_ARGS = {
    "kv_cache_dtype": frozenset({"fp8_e4m3"}),
    "enable_deepseek_v4_fp4_indexer": frozenset({False}),
}
HF_CONFIG = {
    "model_type": "deepseek_v4",
    "qk_nope_head_dim": 448,
    "qk_rope_head_dim": 64,
    "v_head_dim": 512,
    "index_head_dim": 128,
    "num_key_value_heads": 1,
}
# Logits cosine per row against SGLang's standard path on the same GPU. Not measured there: it
# is the floor set by what this project measured between two correct bf16 implementations of the
# model (its reference and fp32 numerics, 0.997 mean cosine on random tiny weights, where
# rounding differences grow fastest), with room for SGLang's kernels' own rounding.
LOGITS_COSINE = 0.99


def contract():
    """SGLang's AMD monokernel contract module (an ImportError where SGLang lacks it)."""
    from sglang.kernels.plugin_kernels.amd import spec

    return spec


@functools.cache
def make_spec():
    """The spec, made once, in the installed SGLang's contract types."""
    api = contract()
    return api.MonoSpec(
        name="dsv4-rocm",
        devices={isa: api.DeviceLimits(widths=WIDTHS, tp_sizes=TP_SIZES, resident_blocks=1)
                 for isa in ISAS},
        features=frozenset(),
        requires=api.Requirements(dtypes=frozenset({"bfloat16"}),
                                  attention_backends=frozenset({"dsv4"}),
                                  server_args=SERVER_ARGS, hf_config=HF_CONFIG),
        numerics=api.Numerics(kind=api.NumericsKind.TOLERANCE,
                              bounds={"forward.logits.cosine": LOGITS_COSINE}),
        model_disable_reasons=model_disable_reasons,
        build=build,
        api_version=API_VERSION,
        config_disable_reasons=config_disable_reasons,
        load_tensor=load_tensor,
        # The forward plans its own step (this project's attention plan), so SGLang's backend
        # can skip the aiter decode schedule of the ratio-4 indexers on the steps it routes here.
        unread_metadata=frozenset({api.StepMetadata.LOW_RATIO_DECODE_SCHEDULE}),
    )


def __getattr__(name: str):
    if name == "SPEC":        # what SGLang's registry reads (SPEC_PATH)
        return make_spec()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_spec() -> str:
    """Register SPEC with the installed SGLang's monokernel registry; returns the line to log.
    A SGLang without the contract, with another version of it, or whose contract does not take
    this spec, is left alone (its standard path runs)."""
    try:
        api = contract()
    except ImportError as e:
        return (f"monokernel spec not registered: SGLang {installed_version('sglang')} has no "
                f"usable AMD monokernel contract ({type(e).__name__}: {e})")
    if api.MONOKERNEL_API_VERSION != API_VERSION:
        return (f"monokernel spec not registered: SGLang's monokernel API is version "
                f"{api.MONOKERNEL_API_VERSION}, this spec is written for version {API_VERSION}")
    try:
        spec = make_spec()
    except Exception as e:    # a contract of the same version whose types changed
        return (f"monokernel spec not registered: SGLang {installed_version('sglang')}'s "
                f"monokernel contract does not take this spec ({type(e).__name__}: {e})")
    api.register(backend=api.BACKEND, architecture=ARCHITECTURE, path=SPEC_PATH)
    return (f"monokernel spec {spec.name} registered for {ARCHITECTURE} "
            f"({', '.join(ISAS)}; decode batch sizes {WIDTHS[0]}-{WIDTHS[-1]}; TP "
            f"{'/'.join(map(str, TP_SIZES))}); --enable-amd-monokernel turns it on")


def coverage() -> list[str]:
    """What the spec covers and refuses, and for the published Flash and Pro models the bytes
    a rank reads in place from SGLang's weights and holds beside them, on gfx942 and gfx950
    (for `python -m dsv4 env`)."""
    from ..config import ModelConfig
    from .sglang_mono_weights import in_place_bytes, model_bytes

    spec = make_spec()
    lines = [
        f"monokernel spec {spec.name} (SGLang --enable-amd-monokernel): {'/'.join(ISAS)}, decode "
        f"batch sizes {WIDTHS[0]}-{WIDTHS[-1]}, TP {'/'.join(map(str, TP_SIZES))}; accepts none "
        "of the features SGLang refuses by default",
        "  requires: dtype bfloat16, decode attention backend dsv4, "
        + ", ".join(f"{k} in {sorted(map(str, v))}" for k, v in SERVER_ARGS.items())
        + "; indexer keys row by row or in 16 x 16 tiles (both read and written)"
        + f"; numerics {spec.numerics.kind.value} (logits cosine >= {LOGITS_COSINE}, not measured "
        "against SGLang's path)",
    ]
    for name in ("flash", "pro"):
        config = ModelConfig.preset(name)
        whole = {tp: model_bytes(config, "native", tp, config.original_seq_len)
                 for tp in TP_SIZES}
        for isa, fnuz in (("gfx942", True), ("gfx950", False)):
            read = {tp: in_place_bytes(config, "native", tp, fnuz) for tp in TP_SIZES}
            per_rank = ", ".join(f"TP{tp} {read[tp] / 2**30:.2f} read in place, "
                                 f"{(whole[tp] - read[tp]) / 2**30:.2f} held"
                                 for tp in TP_SIZES)
            lines.append(f"  {name} on {isa}, weights beside SGLang's (GiB a rank): {per_rank}")
    return lines
