"""The options of a model and its engine as one frozen value, read once from the DSV4_* flags.

Flags are the user's interface, not the code's: ``Options.from_env()`` reads them when a model
(``DeepseekV4Model(..., options=None)``) or an engine (``Engine(..., options=None)``) is made, and
from then on the value travels: the engine hands it to the model's forward, its graphs and its
prefix cache; the forward hands it to every layer as an argument, beside the step's
``AttentionMetadata`` (which holds tensors only); layers and kernel wrappers take the parts they
need as arguments (the kernel half, a ``KernelOptions``, goes by the name ``kernel``). Changing
a flag afterwards changes nothing in a made engine; to run with other options, make the engine
(or pass ``options=``) again. A captured graph keeps the options it was captured with, and
replaying it with others is an error (``dsv4.graphs.GraphFlagChanged``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hip_kernels import envs as kernel_envs
from hip_kernels import numerics as kernel_numerics
from hip_kernels.numerics import StoreNumerics
from hip_kernels.options import DEFAULT_KERNEL_OPTIONS, KernelOptions

from . import envs

GRAPH_BATCH_SIZES = ("pow2", "every")
GRAPH_BACKENDS = ("auto", "cuda", "emulate")


@dataclass(frozen=True)
class Options:
    """numerics: "reference" | "fp32" (DSV4_NUMERICS); kernel: the kernel layer's options
    (backend, value checks, aiter); fused_swa_translate: each layer's window store maps
    out_cache_loc to SWA slots itself (DSV4_FUSED_SWA_TRANSLATE); multi_stream_prepare: the
    compressors on side streams (DSV4_MULTI_STREAM_PREPARE); graph, graph_batch_sizes,
    graph_backend: whether and how decode steps are captured (DSV4_GRAPH*); check_weights: scan
    loaded weights (DSV4_CHECK_WEIGHTS); prefix_cache, prefix_cache_host_pages,
    prefix_cache_dir: the engine's prefix cache (DSV4_PREFIX_CACHE*); prefill_chunk: the most
    prompt tokens one prefill step computes, 0 = sized from the device's memory
    (DSV4_PREFILL_CHUNK)."""

    numerics: str = "reference"
    kernel: KernelOptions = DEFAULT_KERNEL_OPTIONS
    fused_swa_translate: bool = False
    multi_stream_prepare: bool = False
    graph: bool = True
    graph_batch_sizes: str = "every"
    graph_backend: str = "auto"
    check_weights: bool = True
    prefix_cache: bool = False
    prefix_cache_host_pages: int = 0
    prefix_cache_dir: str = ""
    prefill_chunk: int = 0

    # The fields that change what a step computes (and so what a captured graph holds).
    STEP_FIELDS = ("numerics", "kernel", "fused_swa_translate", "multi_stream_prepare")

    def __post_init__(self) -> None:
        kernel_numerics.check_mode(self.numerics)
        for name, value, allowed in (("graph_batch_sizes", self.graph_batch_sizes,
                                      GRAPH_BATCH_SIZES),
                                     ("graph_backend", self.graph_backend, GRAPH_BACKENDS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {'|'.join(allowed)}")
        if isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int) or (
                self.prefill_chunk < 0):
            raise ValueError(f"prefill_chunk={self.prefill_chunk!r}: expected an int >= 1, or 0 "
                             "(sized from the device's memory)")
        if not isinstance(self.kernel, KernelOptions):
            raise TypeError(f"kernel must be a hip_kernels.KernelOptions, got "
                            f"{type(self.kernel).__name__}")

    @classmethod
    def from_env(cls) -> "Options":
        """The options the DSV4_* flags ask for now."""
        return cls(numerics=kernel_envs.NUMERICS.get(), kernel=KernelOptions.from_env(),
                   fused_swa_translate=envs.FUSED_SWA_TRANSLATE.get(),
                   multi_stream_prepare=envs.MULTI_STREAM_PREPARE.get(),
                   graph=envs.GRAPH.get(), graph_batch_sizes=envs.GRAPH_BATCH_SIZES.get(),
                   graph_backend=envs.GRAPH_BACKEND.get(), check_weights=envs.CHECK_WEIGHTS.get(),
                   prefix_cache=envs.PREFIX_CACHE.get(),
                   prefix_cache_host_pages=envs.PREFIX_CACHE_HOST_PAGES.get(),
                   prefix_cache_dir=envs.PREFIX_CACHE_DIR.get(),
                   prefill_chunk=envs.PREFILL_CHUNK.get())

    @property
    def reference(self) -> bool:
        """Whether the model rounds as DeepSeek-V4's reference code (numerics "reference")."""
        return self.numerics == "reference"

    @property
    def store_numerics(self) -> StoreNumerics:
        """The set-KV numerics of the model's own stores in this numerics mode."""
        return kernel_numerics.store_numerics(self.numerics)

    def step_differences(self, other: "Options") -> list[str]:
        """'field: self's value -> other's' for each of STEP_FIELDS that differs."""
        return [f"{name}: {getattr(self, name)!r} -> {getattr(other, name)!r}"
                for name in self.STEP_FIELDS if getattr(self, name) != getattr(other, name)]
