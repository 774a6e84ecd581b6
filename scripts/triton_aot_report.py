"""Register and scratch use of the Triton kernels on AMD targets, compiled without a GPU.

    python scripts/triton_aot_report.py [--arch gfx942 gfx950] [--jobs N] [--json]

Run with TRITON_INTERPRET unset (the kernels are compiled, not interpreted).
"""

import argparse
import json
import os

from hip_kernels.triton_aot import ARCHS, report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=list(ARCHS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compiles at once, one process each (default: the CPU count)")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    args = parser.parse_args(argv)
    rows = report(args.arch, args.jobs)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'arch':7} {'fp8':5} {'kernel':34} {'vgpr':>4} {'sgpr':>4} {'scratch':>7} fp8 convert")
    for r in rows:
        print(f"{r['arch']:7} {r['dialect']:5} {r['kernel']:34} {r['vgpr']:4d} {r['sgpr']:4d} "
              f"{r['scratch_bytes']:7d} {' '.join(r['hw_fp8_convert']) or '-'}")


if __name__ == "__main__":
    main()
