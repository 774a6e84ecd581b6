"""The rounding the kernels run: the model's numerics modes, and `StoreNumerics`, the rounding
policy of a set-KV store.

The modes (`MODES`: "reference", the default, rounds where DeepSeek-V4's reference inference
code rounds; "fp32" keeps those points in fp32; a caller picks one, e.g. from `DSV4_NUMERICS`, and
passes it down): the rounding points of each are listed in docs/numerics.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from .platform import Fp8Dialect

MODES = ("reference", "fp32")
AMAX_FLOOR = 1e-4   # the smallest tile amax a KV scale is computed from

Q_MODES = ("norm_rope", "norm_rope_fp32", "rope_only", "bf16_norm_rope")
RMS_MODES = ("exact", "device")


@dataclass(frozen=True)
class StoreNumerics:
    """How a KV row is computed before it lands in the layout. The byte layout never changes;
    these are the points where writers of the same layout are known to differ, as explicit
    parameters of the set-KV ops:

    - round_to_bf16: the RMSNorm output is rounded to bf16 before RoPE and quantization (as the
      reference inference code). False keeps it fp32 through the norm and the RoPE, and
      quantizes the fp32 values (the RoPE dims are still stored as bf16).
    - rms, how an RMSNorm gets 1 / rms: "exact" sums the squares of the bf16 inputs in fp64,
      where the sum is exact, and takes a correctly rounded 1 / sqrt, so every backend and every
      reduction order gives the same bits; "device" is the reference's
      `rsqrt(x.float().square().mean(-1) + eps)`: an fp32 reduction and the device's rsqrt,
      whose last bits depend on the device's summation order and rsqrt.
    - fp8_max: the clamp and the scale divisor of the fp8 cast; None = the dialect's largest
      finite value (240 fnuz, 448 OCP). Some writers use 224 with fnuz.
    - amax_floor: the smallest tile amax used for a scale (1e-4; some writers use 1e-8).
    - q_mode, what a fused q gets:
      "norm_rope": weightless RMSNorm in fp32 rounded once to bf16, then RoPE of the bf16 values;
      "bf16_norm_rope": the reference's weightless RMSNorm, every op in bf16
      (`q *= rsqrt(q.square().mean(-1) + eps)`), then the same RoPE;
      "norm_rope_fp32": RMSNorm and RoPE in fp32, one rounding to bf16 at the end;
      "rope_only": only its last 64 dims rotated (no norm), each pair rounded as
      `fma(x, cos, round(-y*sin))`, `fma(y, cos, round(x*sin))`.

    `DEFAULT_NUMERICS` (rms "exact", "norm_rope") is what the ops do unless told otherwise;
    `REFERENCE_NUMERICS` (rms "device", "bf16_norm_rope") is the reference's.
    """

    round_to_bf16: bool = True
    fp8_max: float | None = None
    amax_floor: float = AMAX_FLOOR
    q_mode: str = "norm_rope"
    rms: str = "exact"

    def __post_init__(self):
        if self.rms not in RMS_MODES:
            raise ValueError(f"StoreNumerics.rms must be one of {RMS_MODES}, got "
                             f"{self.rms!r}")
        if self.q_mode not in Q_MODES:
            raise ValueError(f"StoreNumerics.q_mode must be one of {Q_MODES}, got {self.q_mode!r}")
        if self.fp8_max is not None and not 0 < self.fp8_max <= 448:
            raise ValueError(f"StoreNumerics.fp8_max must be in (0, 448] or None, got "
                             f"{self.fp8_max}")
        if not self.amax_floor > 0:
            raise ValueError(f"StoreNumerics.amax_floor must be > 0, got {self.amax_floor}")

    def fp8_max_for(self, dialect: Fp8Dialect) -> float:
        """The clamp used with `dialect`: fp8_max, never above the dialect's own maximum."""
        if self.fp8_max is None:
            return dialect.max
        if self.fp8_max > dialect.max:
            raise ValueError(f"StoreNumerics.fp8_max={self.fp8_max} exceeds the {dialect.name} "
                             f"fp8 maximum {dialect.max}")
        return self.fp8_max

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_NUMERICS


DEFAULT_NUMERICS = StoreNumerics()
REFERENCE_NUMERICS = StoreNumerics(q_mode="bf16_norm_rope", rms="device")


def check_mode(mode: str) -> str:
    """mode, when it is one of MODES."""
    if mode not in MODES:
        raise ValueError(f"numerics={mode!r}: expected one of {'|'.join(MODES)}")
    return mode


def store_numerics(mode: str) -> StoreNumerics:
    """The set-KV numerics of the model's own stores in numerics mode `mode` (one of MODES)."""
    return REFERENCE_NUMERICS if check_mode(mode) == "reference" else DEFAULT_NUMERICS
