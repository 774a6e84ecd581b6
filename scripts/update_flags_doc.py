"""Regenerate the flag table of docs/flags.md from the flag declarations (run after adding a flag).

tests/runtime/test_flags.py fails while the table is out of date, so a new flag cannot land without it.
"""

import argparse
from pathlib import Path

from dsv4 import flags_table as ft

FLAGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "flags.md"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when the table is out of date")
    args = p.parse_args(argv)
    text = FLAGS_DOC.read_text()
    begin = text.index(ft.TABLE_BEGIN) + len(ft.TABLE_BEGIN)
    end = text.index(ft.TABLE_END)
    new = text[:begin] + "\n" + ft.docs_table() + "\n" + text[end:]
    if args.check:
        print(f"{FLAGS_DOC} flag table is " + ("up to date" if new == text else "out of date"))
        return 0 if new == text else 1
    FLAGS_DOC.write_text(new)
    print(f"wrote the flag table into {FLAGS_DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
