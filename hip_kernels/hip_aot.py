"""Compile the HIP C++ set-KV kernel (hip_kernels/csrc) without a GPU, to check that it builds
and to read its register and scratch use (report: scripts/hip_aot_report.py).

AMD targets: the sources are hipified exactly as torch.utils.cpp_extension does on ROCm, then
compiled for the device only by clang from the `ziglang` package (pip install -e .[cpu]) with
the HIP headers and device libraries that ship inside the `triton` wheel. NVIDIA: nvcc.
The kernel translation unit has no torch headers; the binding is syntax-checked separately
(`check_binding`) with the host C++ compiler against torch's headers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
KERNEL = "set_kv_kernels.cu"
BINDING = "set_kv_binding.cpp"
HW_FP8_CONVERT = "v_cvt_pk_fp8_f32"
AMD_ARCHS = ("gfx942", "gfx950")
# hip_runtime.h includes clang's CUDA wrapper headers (std::complex / <algorithm> in device code);
# zig's clang ships without them. The kernel uses neither, so empty stand-ins suffice.
WRAPPER_STUBS = ("__clang_cuda_math_forward_declares.h", "__clang_cuda_complex_builtins.h",
                 "include/cuda_wrappers/algorithm", "include/cuda_wrappers/complex",
                 "include/cuda_wrappers/new")


class ToolMissing(RuntimeError):
    pass


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ToolMissing(f"the `{name}` package is not installed (pip install -e .[cpu])")
    return Path(list(spec.submodule_search_locations)[0])


def hip_toolchain() -> dict:
    """Paths of the HIP compile toolchain (raises ToolMissing)."""
    amd = _package_dir("triton") / "backends" / "amd"
    if not (amd / "include" / "hip" / "hip_runtime.h").exists():
        raise ToolMissing(f"triton at {amd.parent.parent} ships no HIP headers")
    return {"clang": [sys.executable, "-m", "ziglang", "clang"],
            "clang_include": _package_dir("ziglang") / "lib" / "include",
            "hip_include": amd / "include",
            "device_libs": sorted((amd / "lib").glob("oc*.bc"))}


def hipify_sources(dst: Path) -> Path:
    """Copy csrc to dst and hipify it as torch does on ROCm; returns the hipified kernel file."""
    from torch.utils.hipify import hipify_python

    for f in CSRC.iterdir():
        shutil.copyfile(f, dst / f.name)
    with contextlib.redirect_stderr(io.StringIO()):  # it prints a banner when done
        result = hipify_python.hipify(project_directory=str(dst), output_directory=str(dst),
                                      extra_files=[str(dst / KERNEL)], is_pytorch_extension=True,
                                      show_detailed=False, show_progress=False)
    return Path(result[str(dst / KERNEL)].hipified_path)


def compile_amdgcn(arch: str, hip_source: Path, workdir: Path) -> str:
    """Device-only compile of a hipified kernel file for an AMD arch; returns the assembly."""
    tc = hip_toolchain()
    stubs = workdir / "clang_wrapper_stubs"
    for name in WRAPPER_STUBS:
        (stubs / name).parent.mkdir(parents=True, exist_ok=True)
        (stubs / name).write_text("#pragma once\n")
    out = workdir / f"{hip_source.stem}_{arch}.s"
    cmd = [*tc["clang"], "-x", "hip", "-std=c++20", "-O3", f"--offload-arch={arch}",
           "--cuda-device-only", "-nogpuinc", "-nogpulib", "-S", "-o", str(out),
           "-isystem", str(stubs), "-isystem", str(tc["clang_include"]),
           "-isystem", str(tc["hip_include"]),
           # what torch.utils.cpp_extension defines for HIP extensions
           "-D__HIP_PLATFORM_AMD__=1", "-DUSE_ROCM=1", "-DHIP_ENABLE_WARP_SYNC_BUILTINS=1"]
    for lib in tc["device_libs"]:
        cmd += ["-Xclang", "-mlink-builtin-bitcode", "-Xclang", str(lib)]
    _run(cmd + [str(hip_source)])
    return out.read_text()


def amdgcn_kernel_stats(asm: str) -> dict:
    """Per kernel (by dialect): VGPRs, SGPRs (total, as the occupancy calculator counts them),
    spills, scratch bytes, hardware fp8 converts, calls and IEEE division in its code."""
    stats = {}
    for entry in asm.split("\n  - ")[1:]:
        name = re.search(r"\.name:\s+(\S+)", entry)
        if not name or "set_kv_kernel" not in name.group(1):
            continue
        sym = name.group(1)
        field = {k: int(re.search(rf"\.{k}:\s+(\d+)", entry).group(1))
                 for k in ("vgpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count",
                           "private_segment_fixed_size")}
        body = asm[asm.index(f"\n{sym}:"):]
        body = body[:re.search(r"\n\.Lfunc_end\d+:", body).start()]
        stats[_dialect_of(sym)] = {
            "vgpr": field["vgpr_count"], "sgpr": field["sgpr_count"],
            "spills": field["vgpr_spill_count"] + field["sgpr_spill_count"],
            "scratch_bytes": field["private_segment_fixed_size"],
            "hw_fp8_converts": body.count(HW_FP8_CONVERT),
            "calls": body.count("s_swappc_b64"),
            "ieee_div": "v_div_fixup_f32" in body,
        }
    return stats


def _dialect_of(symbol: str) -> str:
    # set_kv_kernel<Fp8Dialect::Fnuz = 0 | Ocp = 1>, mangled as ...Fp8DialectE0E... / ...E1E...
    return {"0": "fnuz", "1": "ocp"}[re.search(r"Fp8DialectE(\d)E", symbol).group(1)]


def compile_sm90(workdir: Path) -> dict:
    """nvcc compile (device and host code) for sm_90; per kernel registers and spills."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise ToolMissing("nvcc is not on PATH")
    log = _run([nvcc, "-std=c++20", "-O3", "-arch=sm_90", "-c", "-Xptxas", "-v",
                "-o", str(workdir / "set_kv_kernels_sm90.o"), str(CSRC / KERNEL)])
    stats = {}
    for sym, body in re.findall(r"Compiling entry function '(\S+)' for 'sm_90'(.*?)Compile time",
                                log, re.S):
        regs = int(re.search(r"Used (\d+) registers", body).group(1))
        stack, spill_st, spill_ld = map(int, re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
            body).groups())
        stats[_dialect_of(sym)] = {"registers": regs, "stack_bytes": stack,
                                   "spills": spill_st + spill_ld}
    return stats


def check_binding() -> None:
    """Syntax-check the torch binding with the host C++ compiler (CUDA flavour; torch's CPU
    wheel lacks the generated c10/cuda macro header, hence C10_CUDA_NO_CMAKE_CONFIGURE_FILE)."""
    from torch.utils import cpp_extension

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise ToolMissing("no host C++ compiler (c++/g++) on PATH")
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror",
           "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-I", str(CSRC)]
    for inc in cpp_extension.include_paths() + [_cuda_include_dir()]:
        cmd += ["-isystem", inc]
    _run(cmd + [str(CSRC / BINDING)])


def _cuda_include_dir() -> str:
    """Where nvcc finds cuda_runtime.h (nvcc may be a wrapper script, so ask it)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise ToolMissing("the binding's CUDA headers come with nvcc, which is not on PATH")
    dry = _run([nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"])
    return re.search(r'INCLUDES="-I([^"]+?)"', dry).group(1).strip()


def _run(cmd) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}\nfailed ({proc.returncode}):\n"
                           f"{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr


def report(archs=(*AMD_ARCHS, "sm_90")) -> dict:
    """arch -> dialect -> build statistics, compiling in a temporary directory."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hip_source = hipify_sources(work) if set(archs) & set(AMD_ARCHS) else None
        for arch in archs:
            if arch == "sm_90":
                out[arch] = compile_sm90(work)
            else:
                out[arch] = amdgcn_kernel_stats(compile_amdgcn(arch, hip_source, work))
    return out
