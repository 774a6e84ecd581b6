"""The CPU kernel set: what, besides the torch version, decides the last bits of a CPU run of the
reference (and of this repository's model), as the reference-logits fixtures record it.

- ``cpu_capability``: torch's own vectorized kernels (``torch.backends.cpu.get_cpu_capability()``:
  AVX2, AVX512, ...).
- ``cpu_vendor``: MKL, which computes torch's fp32 GEMMs and its vectorized exp, log, sqrt, tanh
  and erf, runs its code for the CPU's instruction set on an Intel CPU and a generic path on
  any other (``vendor_id`` of /proc/cpuinfo).
- ``bf16_gemm``: torch sends bf16 matmuls to oneDNN on a CPU with AVX-512 (F, BW, VL, DQ), which
  uses AMX tiles (``amx``), AVX512_BF16 dot products (``avx512_bf16``) or plain AVX-512
  (``avx512``), by what the CPU has; elsewhere torch's own kernels compute them (``aten``).

The vendor and the bf16 kernels were measured to change the tiny preset's reference logits
(docs/numerics.md); torch's AVX2 and AVX512 kernels gave the same logits there but round other
ops differently (a softmax over 333 columns: 45% of its values). The list is what was found, not
a proof that nothing else matters: a fixture whose kernel set matches a machine's but whose bits
do not names one more thing to add here.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

KEYS = ("cpu_capability", "cpu_vendor", "bf16_gemm")


def cpu_vendor() -> str:
    """The CPU's vendor id (GenuineIntel, AuthenticAMD, ...), "unknown" where Linux does not
    name one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    found = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.MULTILINE)
    return found.group(1) if found else "unknown"


def bf16_gemm() -> str:
    """Which kernels compute torch's bf16 matmuls here: amx, avx512_bf16, avx512 (oneDNN) or
    aten (torch's own)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and torch.cpu._is_avx512_supported()):
        return "aten"
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512"


def kernel_set() -> dict[str, str]:
    """This machine's kernel set: {key: value} for each of KEYS."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_vendor": cpu_vendor(), "bf16_gemm": bf16_gemm()}


def label(kernels: dict[str, str]) -> str:
    """The kernel set as a fixture's file name ends: e.g. AVX512-GenuineIntel-amx."""
    return "-".join(kernels[k] for k in KEYS)
