"""Register, spill and scratch use of the HIP C++ set-KV kernel, compiled without a GPU for
gfx942 / gfx950 (ziglang clang + triton's HIP headers) and sm_90 (nvcc).

    python scripts/hip_aot_report.py [--arch gfx942 gfx950 sm_90] [--json]
"""

import argparse
import json

from hip_kernels.hip_aot import AMD_ARCHS, report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=[*AMD_ARCHS, "sm_90"])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    stats = report(args.arch)
    if args.json:
        print(json.dumps(stats))
        return
    for arch, kernels in stats.items():
        for dialect, s in kernels.items():
            print(f"{arch:7s} {dialect:5s} " + " ".join(f"{k}={v}" for k, v in s.items()))


if __name__ == "__main__":
    main()
