"""Regenerate the README's flag table from the flag declarations (run after adding a flag)."""

from pathlib import Path

from dsv4 import flags_table as ft

readme = Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
begin = text.index(ft.README_BEGIN) + len(ft.README_BEGIN)
end = text.index(ft.README_END)
readme.write_text(text[:begin] + "\n" + ft.readme_table() + "\n" + text[end:])
