"""Command line: `python -m dsv4 env` (flags) and `python -m dsv4 generate` (the main job)."""

from __future__ import annotations

import argparse
import sys


def _cmd_env(args: argparse.Namespace) -> int:
    from . import flags_table

    if args.markdown:
        print(flags_table.readme_table())
        return 0
    rows = flags_table.values_table()
    w = max(len(r[0]) for r in rows)
    vw = max(len(r[1]) for r in rows)
    print(f"{'flag':<{w}}  {'value':<{vw}}  source   meaning")
    for name, value, source, help_ in rows:
        print(f"{name:<{w}}  {value:<{vw}}  {source:<7}  {help_}")
    return 1 if any(r[1].startswith("ERROR") for r in rows) else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsv4", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print every DSV4_* flag with its value and source")
    env.add_argument("--markdown", action="store_true", help="print the README table instead")
    env.set_defaults(func=_cmd_env)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
