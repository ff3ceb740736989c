"""The CPU worker's allocator settings (vllm_lite/worker/cpu_malloc.py): with them, freed
blocks of megabytes are reused instead of being faulted in again, measured as the page
faults of a loop that allocates and frees the way a step does; a user's own glibc settings
win; an engine on the CPU applies them. Each case runs in a fresh process (the settings
are process-wide)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from entrypoints.utils import run_python_json  # noqa: E402
from vllm_lite.worker.cpu_malloc import USER_SETTINGS  # noqa: E402

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="needs Linux with glibc")

# Three 8 MiB tensors alive together, written, then freed, 20 times: with glibc's default
# thresholds each round faults its pages in again.
STEP_LOOP = """
import json, resource, sys, torch
from vllm_lite.worker import cpu_malloc
tuned = cpu_malloc.keep_freed_memory() if sys.argv[1] == "tune" else None
def round_():
    ts = [torch.full((2 << 20,), float(i)) for i in range(3)]
    return sum(float(t[-1]) for t in ts)
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    round_()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    # The tests' own allocator settings must not leak into the children.
    return run_python_json(code, *args, env=env, unset=USER_SETTINGS)


def test_freed_blocks_are_reused_not_faulted_again() -> None:
    # The control pins glibc's default thresholds: left to itself glibc adapts them at run
    # time, and whether these blocks are kept then depends on the order of the process's
    # other allocations (it faulted them again in some runs and not in others).
    plain = _run(STEP_LOOP, "plain", env={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    tuned = _run(STEP_LOOP, "tune")
    assert tuned["tuned"] is True
    # 20 rounds x 24 MiB is ~123k pages: the default thresholds fault most of them again.
    assert plain["faults"] > 20 * 2000, plain
    assert tuned["faults"] < plain["faults"] / 10, (tuned, plain)


def test_user_settings_win() -> None:
    got = _run(STEP_LOOP, "tune", env={"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert got["tuned"] is False
    assert got["faults"] > 20 * 2000, got  # the user's small threshold is in force


def test_cpu_engine_applies_them(model_dir: Path) -> None:
    got = _run(f"""
import json
from pathlib import Path
from entrypoints.utils import make_llm
from vllm_lite.worker import cpu_malloc
before = cpu_malloc._applied
make_llm(Path({str(model_dir)!r}))
print(json.dumps({{"before": before, "after": cpu_malloc._applied}}))
""")
    assert got == {"before": False, "after": True}
