"""CI runs what the README tells a user to run: the lines of .ci/run after its marker are
the README's "Install and pass the tests" block, byte for byte."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = "# --- the README's test steps\n"


def test_ci_runs_the_readme_test_steps():
    readme = (REPO / "README.md").read_text()
    head = readme.index("Install and pass the tests")
    block = re.search(r"```bash\n(.*?)```", readme[head:], re.S)
    assert block, "the README's test block is missing"
    ci = (REPO / ".ci" / "run").read_text()
    assert ci.count(MARKER) == 1, f".ci/run needs the marker line {MARKER!r}"
    assert ci.split(MARKER, 1)[1] == block.group(1)
    # Every step is numbered, one command per line.
    steps = [line for line in block.group(1).splitlines() if not line.startswith("#")]
    assert any(re.fullmatch(r"pytest -q( -\S+( \d+| \w+)?)* tests", s) for s in steps), steps
    assert len(steps) >= 8
