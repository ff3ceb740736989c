"""The README's engine-options table is the one tools/readme_options.py generates from
EngineArgs: a new option, a changed default or help text fails here until the table is
regenerated (``python3 tools/readme_options.py``)."""

from __future__ import annotations

import importlib.util
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("readme_options",
                                                  REPO / "tools" / "readme_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_options_table_is_current():
    tool = _tool()
    readme = (REPO / "README.md").read_text()
    assert tool.splice(readme, tool.render()) == readme, (
        "README.md's options table is stale: run python3 tools/readme_options.py")


def test_table_lists_every_option_with_its_default():
    from vllm_lite.config import EngineArgs

    table = _tool().render()
    for f in fields(EngineArgs):
        row = next((r for r in table.splitlines() if r.startswith(f"| `{f.name}` |")), None)
        assert row is not None, f.name
        assert f"`{EngineArgs.flag(f.name)}`" in row
        if f.default is not None and not isinstance(f.default, bool):
            assert f"`{f.default}`" in row, row
