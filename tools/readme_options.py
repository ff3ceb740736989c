"""Writes the README's engine-options table from ``EngineArgs``, the one place every option
and its default live, so the table cannot drift from the code.

    python3 tools/readme_options.py          # rewrite the table between the markers
    python3 tools/readme_options.py --check  # exit 1 if the README's table is stale

``tests/test_readme_options.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN = "<!-- BEGIN options: generated from EngineArgs by tools/readme_options.py -->"
END = "<!-- END options -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(field, meta) -> str:
    value = field.default if field.default is not MISSING else None
    if value is None:
        return _cell(meta.get("none_means") or "none")
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def render() -> str:
    """The table, markers included."""
    sys.path.insert(0, str(REPO))
    from vllm_lite.config import EngineArgs

    rows = ["| `LLM(...)` keyword | CLI flag | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields(EngineArgs):
        meta = dict(f.metadata)
        help_text = meta.get("help", "")
        if meta.get("metavar"):  # what --help shows for the value, aliases left out
            help_text += f" ({meta['metavar']})"
        elif meta.get("choices"):
            help_text += " (one of: " + ", ".join(str(c) for c in meta["choices"]) + ")"
        flag = EngineArgs.flag(f.name)
        rows.append(f"| `{f.name}` | `{flag}` | {_default(f, meta)} | {_cell(help_text)} |")
    return "\n".join([BEGIN, *rows, END])


def splice(readme: str, table: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise SystemExit(f"README.md needs one {BEGIN!r} and one {END!r} line")
    head, rest = readme.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return head + table + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 (printing the fresh table) if the README's is stale")
    args = parser.parse_args(argv)
    readme = README.read_text()
    fresh = splice(readme, render())
    if args.check:
        if fresh != readme:
            print("README.md's options table is stale; run python3 tools/readme_options.py\n")
            print(render())
            return 1
        return 0
    if fresh != readme:
        README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
