"""The CPU worker's allocator settings (vllm_lite/worker/cpu_malloc.py): with them, freed
blocks of megabytes are reused instead of being faulted in again, measured as the page
faults of a loop that allocates and frees the way a step does; a user's own glibc settings
win; an engine on the CPU applies them. Each case runs in a fresh process (the settings
are process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from entrypoints.utils import cli_env  # noqa: E402

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="needs Linux with glibc")

ROOT = Path(__file__).resolve().parents[2]

# Three 8 MiB tensors alive together, written, then freed: 24 MiB free at once is over
# glibc's default trim threshold even after its mmap threshold adapts, so without the
# settings every round faults its pages in again.
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


def _run(code: str, *args: str, env_extra: dict[str, str] | None = None) -> dict:
    # The vllm_lite these tests import (installed in CI, where the checkout has no _C).
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "tests")])
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(name, None)
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=300, env=env, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_not_faulted_again() -> None:
    plain = _run(STEP_LOOP, "plain")
    tuned = _run(STEP_LOOP, "tune")
    assert tuned["tuned"] is True
    # 20 rounds x 24 MiB is ~123k pages: the default allocator faults most of them again.
    assert plain["faults"] > 20 * 2000, plain
    assert tuned["faults"] < plain["faults"] / 10, (tuned, plain)


def test_user_settings_win() -> None:
    got = _run(STEP_LOOP, "tune", env_extra={"MALLOC_TRIM_THRESHOLD_": "131072"})
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
