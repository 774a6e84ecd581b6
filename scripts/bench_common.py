"""Shared helpers of the benchmark scripts: timing, launch counting, environment record, command
line, progress bar and JSON output.

Import it from any script in ``scripts/`` as ``import bench_common`` (a script's own directory is
on ``sys.path``). Every helper works on the device present: a ROCm/CUDA GPU or the CPU.

Timing (`time_op`): ``warmup`` untimed calls, then ``reps`` timed calls, one sample per call.
  GPU: a ``torch.cuda.Event`` pair around each call, one synchronize at the end (device time
  between the two events: host launch gaps and host syncs inside the call are included).
  CPU: ``time.perf_counter`` around each call.
  `Timing.summary()` -> {"p50_us", "p90_us", "mean_us", "min_us", "reps", "clock"}; percentiles
  are nearest-rank; clock is "cuda_event" or "perf_counter".

Launch counting (`count_launches`): runs the callable once. (`count_dispatcher_ops`: the CPU
  counter below, on any device.)
  GPU, counter "device_kernels": kernels that ``torch.profiler`` saw on the device; memcpy/memset
  are not kernels; device->host copies are reported as ``host_syncs``.
  CPU, counter "cpu_aten_ops": a proxy, the aten ops that would be kernels on a GPU, counted with a
  TorchDispatchMode: the outermost aten ops below autograd, except views and allocations (the
  ops the CPU graph emulation re-runs at replay). ``host_syncs`` counts
  ``aten::_local_scalar_dense`` (``.item()``, ``int(t)``) and calls of ``Tensor.tolist()``.
  `LaunchCount.summary()` -> {"counter", "launches", "host_syncs", "by_name"}.

Record (`new_record`): every script's JSON starts with these keys:
  "benchmark" (script name), "schema_version", "created" (UTC ISO time), "argv", "quick",
  "device" ("cuda" on a ROCm/CUDA GPU, else "cpu"), "env" (see `environment`), "config".

Environment (`environment`): "platform" (hip_kernels.platform.describe()), "python", "torch",
  "triton" (installed distribution version or None), "hip", "cuda", "gpu_name", "gpu_arch",
  "gpu_count", "cpu_model" (`cpu_model`), "cpu_count", "torch_threads", "machine",
  "rocm_smi_productname" (`rocm-smi --showproductname` output, None when absent),
  "hipconfig_version", "git_commit", "flags" (every DSV4_* flag: name -> {"value", "source"}).
  `machine_name`: the GPU's name, else the CPU's model, for a table's caption.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform as py_platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary
from tqdm import tqdm

SCHEMA_VERSION = 1
REPO = Path(__file__).resolve().parent.parent
RECORD_KEYS = ("benchmark", "schema_version", "created", "argv", "quick", "device", "env",
               "config")
ENV_KEYS = ("platform", "python", "torch", "triton", "hip", "cuda", "gpu_name", "gpu_arch",
            "gpu_count", "cpu_model", "cpu_count", "torch_threads", "machine",
            "rocm_smi_productname", "hipconfig_version", "git_commit", "flags")

# ---- device and timing ---------------------------------------------------------------------


def on_gpu() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda" if on_gpu() else "cpu")


def synchronize() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def _nearest_rank(sorted_values: list[float], q: float) -> float:
    k = math.ceil(round(q * len(sorted_values), 9))
    return sorted_values[min(max(k, 1), len(sorted_values)) - 1]


@dataclass
class Timing:
    samples_us: list[float]
    clock: str

    @property
    def p50(self) -> float:
        return _nearest_rank(sorted(self.samples_us), 0.5)

    @property
    def p90(self) -> float:
        return _nearest_rank(sorted(self.samples_us), 0.9)

    def summary(self) -> dict:
        return {"p50_us": round(self.p50, 3), "p90_us": round(self.p90, 3),
                "mean_us": round(sum(self.samples_us) / len(self.samples_us), 3),
                "min_us": round(min(self.samples_us), 3), "reps": len(self.samples_us),
                "clock": self.clock}


def time_op(fn: Callable[[], object], warmup: int, reps: int) -> Timing:
    """Time fn() reps times after warmup untimed calls (see the module docstring)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    synchronize()
    if on_gpu():
        pairs = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return Timing([s.elapsed_time(e) * 1000.0 for s, e in pairs], "cuda_event")
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return Timing(samples, "perf_counter")


# ---- launch counting -----------------------------------------------------------------------

# Aten ops (overload packets) that launch no kernel besides views: allocations, metadata.
NO_KERNEL_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                           "new_empty_strided", "lift_fresh", "resize_", "set_"})
HOST_SYNC_OPS = frozenset({"_local_scalar_dense"})


@dataclass
class LaunchCount:
    counter: str                       # "device_kernels" | "cpu_aten_ops"
    launches: int
    host_syncs: int
    by_name: dict[str, int] = field(default_factory=dict)
    # On a CPU, with device_tensors given: the host reads of data derived from those tensors
    # (what a GPU run would wait for), leaving out reads of host-side bookkeeping tensors.
    device_syncs: int | None = None

    def summary(self) -> dict:
        return {"counter": self.counter, "launches": self.launches,
                "host_syncs": self.host_syncs, "by_name": dict(sorted(self.by_name.items()))}


class _AtenOpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher below autograd (outermost only: ops that a
    kernel implementation calls internally are not seen), except views and allocations."""

    def __init__(self, device_tensors=()) -> None:
        super().__init__()
        self.by_name: dict[str, int] = {}
        self.host_syncs = 0
        self.device_syncs = 0
        # Tensors holding device data: the seeds and every op output computed from one of them.
        self.derived = WeakIdKeyDictionary({t: True for t in device_tensors})

    def is_device_data(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.derived

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        from_device = any(self.is_device_data(t) for t in tree_leaves((args, kwargs)))
        if name in HOST_SYNC_OPS:
            self.host_syncs += 1
            self.device_syncs += from_device
        elif not func.is_view and name not in NO_KERNEL_OPS:
            key = f"{func.namespace}::{name}"
            self.by_name[key] = self.by_name.get(key, 0) + 1
        out = func(*args, **kwargs)
        if from_device:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.derived[t] = True
        return out


def _count_device(events) -> LaunchCount:
    from torch.autograd import DeviceType

    by_name: dict[str, int] = {}
    syncs = 0
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        name = e.name.lower().replace(" ", "")
        if "memcpy" in name or "memset" in name or name.startswith("copy"):
            syncs += any(k in name for k in ("dtoh", "devicetohost", "d2h"))
            continue
        by_name[e.name] = by_name.get(e.name, 0) + 1
    return LaunchCount("device_kernels", sum(by_name.values()), syncs, by_name)


def count_launches(fn: Callable[[], object], device_tensors=()) -> LaunchCount:
    """Run fn() once and count what it launched (see the module docstring). device_tensors
    (CPU counter only): the tensors that live on the device in a GPU run (model weights, KV
    pool); host reads of data computed from them are counted apart as device_syncs."""
    if on_gpu():
        from torch.profiler import ProfilerActivity, profile

        synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            synchronize()
        return _count_device(prof.events())
    return count_dispatcher_ops(fn, device_tensors)


def count_dispatcher_ops(fn: Callable[[], object], device_tensors=()) -> LaunchCount:
    """count_launches' CPU counter on any device: the dispatcher ops fn() runs (outermost, less
    views and allocations). Calls nest: an op run inside an inner count is counted by both."""
    counter = _AtenOpCounter(device_tensors)
    tolist_calls = device_tolist_calls = 0
    original = torch.Tensor.tolist

    def counting_tolist(self):
        nonlocal tolist_calls, device_tolist_calls
        tolist_calls += 1
        device_tolist_calls += counter.is_device_data(self)
        return original(self)

    torch.Tensor.tolist = counting_tolist
    try:
        with counter:
            fn()
    finally:
        torch.Tensor.tolist = original
    return LaunchCount("cpu_aten_ops", sum(counter.by_name.values()),
                       counter.host_syncs + tolist_calls, counter.by_name,
                       counter.device_syncs + device_tolist_calls if device_tensors else None)


# ---- environment ---------------------------------------------------------------------------


def _run(cmd: list[str], timeout: float = 20.0) -> str | None:
    """stdout of a command, or None when it is absent or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def flag_values() -> dict[str, dict[str, str]]:
    """Every DSV4_* flag as this process sees it: name -> {"value", "source"}."""
    from dsv4 import flags_table

    return {name: {"value": value, "source": source}
            for name, value, source, _ in flags_table.values_table()}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name" on Linux, else what the platform
    says; "unknown" when neither does)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return py_platform.processor() or "unknown"


def machine_name() -> str:
    """What ran the numbers: the GPU's name, else the CPU's model."""
    return torch.cuda.get_device_name(0) if on_gpu() else cpu_model()


def environment() -> dict:
    """Where the numbers come from (keys in the module docstring)."""
    from hip_kernels import platform

    gpu = on_gpu()
    return {
        "platform": platform.describe(),
        "python": py_platform.python_version(),
        "torch": torch.__version__,
        "triton": _dist_version("triton", "pytorch-triton-rocm"),
        "hip": getattr(torch.version, "hip", None),
        "cuda": torch.version.cuda,
        "gpu_name": torch.cuda.get_device_name(0) if gpu else None,
        "gpu_arch": platform.gpu_arch(),
        "gpu_count": torch.cuda.device_count() if gpu else 0,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": py_platform.machine(),
        "rocm_smi_productname": _run(["rocm-smi", "--showproductname"]),
        "hipconfig_version": _run(["hipconfig", "--version"]),
        "git_commit": _run(["git", "rev-parse", "HEAD"]),
        "flags": flag_values(),
    }


# ---- command line, record, output ----------------------------------------------------------


def parser(description: str, default_out: str, repetitions: bool = True
           ) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark script takes (--warmup and --reps
    only with repetitions)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sweep, few repetitions (a CPU smoke run; what the tests run)")
    p.add_argument("--out", default=default_out, help=f"JSON output file (default {default_out})")
    if repetitions:
        p.add_argument("--warmup", type=int, default=None,
                       help="untimed calls before timing (default: 2 quick, 10 full)")
        p.add_argument("--reps", type=int, default=None,
                       help="timed calls per measurement (default: 5 quick, 50 full)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 without a GPU, where the benchmark "
                        "tensors are tiny and extra threads only add contention; else torch's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def resolve_repetitions(args: argparse.Namespace) -> None:
    """Fill the --warmup, --reps and --threads defaults (from --quick and the device); apply
    --threads."""
    if args.threads is None and not on_gpu():
        args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if getattr(args, "warmup", 0) is None:
        args.warmup = 2 if args.quick else 10
    if getattr(args, "reps", 0) is None:
        args.reps = 5 if args.quick else 50


def int_list(text: str) -> list[int]:
    """argparse type: '1,2,4' -> [1, 2, 4]."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def check_choices(p: argparse.ArgumentParser, option: str, values, known) -> None:
    """Exit through the parser, naming the option, when a value is not one of `known`."""
    unknown = [v for v in values if v not in known]
    if unknown:
        p.error(f"--{option}: unknown {unknown}; choose from {list(known)}")


def new_record(benchmark: str, args: argparse.Namespace, config: dict) -> dict:
    return {
        "benchmark": benchmark,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "quick": bool(args.quick),
        "device": device().type,
        "env": environment(),
        "config": config,
    }


def progress(total: int, desc: str, disable: bool = False) -> tqdm:
    """A progress bar on stderr (stdout stays free for results), only when stderr is a terminal
    (tqdm's disable=None): a log file or a pipe gets no bar."""
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=True if disable else None,
                dynamic_ncols=True, leave=False)


def write_json(path: str | os.PathLike, record: dict) -> Path:
    """Write the record (indented, keys in insertion order); creates parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    return path


def write_kernel_record(path: str | os.PathLike, record: dict, skipped: dict[str, str]) -> Path:
    """Write a kernel benchmark's record, then say which backends it skipped and why, and its
    notes (one line each), before the script prints its table."""
    written = write_json(path, record)
    for backend, reason in skipped.items():
        print(f"skipped {backend}: {reason}")
    for note in record["notes"]:
        print(f"note: {note}")
    return written


if __name__ == "__main__":  # the environment record alone, as JSON (used by mi300_sweep.sh)
    print(json.dumps(environment(), indent=1))
