"""The compat tests' emulated backend builds the CUDA emulator with every attention kernel
when the run selected a full_grid test, else with the default list (see
tests/cuda_emulation/harness.py)."""

from __future__ import annotations

import pytest

from cuda_emulation import harness  # tests/ is on sys.path (rootdir-based packages)


@pytest.fixture(autouse=True, scope="session")
def _emulator_kernels(request: pytest.FixtureRequest) -> None:
    harness.use_every_kernel(request.session)
