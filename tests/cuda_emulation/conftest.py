"""Fixtures of the CUDA emulation tests: the emulator binary (built once per session, with
every attention kernel when the run selected a full_grid test, else the default list; or
the tests skip with the reason when this machine cannot build it) and case folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import harness


def case_dir(root: Path, name: str) -> harness.CaseDir:
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    return harness.CaseDir(d)


@pytest.fixture(autouse=True, scope="session")
def emu_binary(request: pytest.FixtureRequest):
    harness.use_every_kernel(request.session)
    try:
        return harness.binary()
    except harness.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
