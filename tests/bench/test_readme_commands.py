"""Every benchmark command the README gives in quick mode (``python3 benchmarks/X.py --quick``,
``vllm-lite bench X --quick``) runs as written from a clean clone, after the README's
install (a non-editable ``pip install .``): with the clone as the working directory, whose
vllm_lite has no compiled ``_C``, the scripts must use the installed package.

To stay within seconds, each command gets extra flags that shrink its quick mode further
(a tiny random model, a few tokens, one small kernel shape); the command itself, the
entry point, the imports and the report writing are the README's. The commands run side
by side, one thread each (about 45 s in all on 2 cores).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from models.helpers import make_config, make_tokenizer, save_hf_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# A guard against a hung command, not the expected time: the whole test takes about 45 s on
# 2 busy cores, but a machine other jobs share can stretch every command alike.
TIMEOUT = 240


def readme_quick_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    found = re.findall(r"`((?:python3 benchmarks/\w+\.py|vllm-lite bench \w+) --quick)`", text)
    return sorted(set(found))


def _tiny_flags(command: str, model: Path, out: Path) -> list[str]:
    """Flags that shrink a command's quick mode to a few seconds."""
    if "kernels" in command:
        return ["--batches", "1", "--contexts", "32", "--heads", "9/3x64", "--dtypes", "fp32",
                "--pool-gib", "0.001", "--mem-gib", "0.25", "--bandwidth-gib", "0.01",
                "--target-s", "0.001", "--min-iters", "1", "--max-iters", "1",
                "--warmup", "0", "--no-flush", "--threads", "1", "--out", str(out)]
    engine = ["--model", str(model), "--kv-cache-space", "0.01", "--block-size", "4",
              "--threads", "1", "--out", str(out), "--engines", "vllm_lite", "--no-progress"]
    if "throughput" in command:
        return engine + ["--num-requests", "2", "--input-len", "4-8", "--output-len", "2-3",
                         "--no-sweeps"]
    if "latency" in command:
        return engine + ["--prompt-len", "4", "--output-len", "2", "--iters", "1",
                         "--num-requests", "0"]
    if "serving" in command:
        return ["--model", str(model), "--kv-cache-space", "0.01", "--threads", "1",
                "--rates", "inf", "--num-prompts", "2", "--input-len", "4",
                "--output-len", "2", "--out", str(out), "--startup-timeout", str(TIMEOUT)]
    if "step_profile" in command or "bench profile" in command:
        return ["--model", str(model), "--kv-cache-space", "0.01", "--threads", "1",
                "--dtype", "float32", "--num-requests", "2", "--input-len", "4",
                "--output-len", "3", "--out", str(out)]
    if "elementwise" in command:
        return ["--rows", "1", "3", "--target-s", "0.001", "--threads", "1", "--hidden", "40",
                "--intermediate", "24", "--heads", "2/1x8", "--out", str(out)]
    if "sampler" in command:
        return ["--rows", "2", "--vocab", "300", "--target-s", "0.001", "--threads", "1",
                "--out", str(out)]
    if "linear" in command:
        return ["--shapes", "64x32", "--rows", "1", "3", "--target-s", "0.001", "--threads",
                "1", "--out", str(out)]
    raise AssertionError(f"no tiny settings for {command!r}: add them here")


def _argv(command: str) -> list[str]:
    words = command.split()
    if words[0] == "python3":
        return [sys.executable] + words[1:]
    exe = shutil.which("vllm-lite")
    if exe is not None:
        return [exe] + words[1:]
    # No console script on PATH: the same entry point, without the working directory on
    # sys.path (-P), as the console script would run it.
    return [sys.executable, "-P", "-c", "import sys; from vllm_lite.entrypoints.cli import "
            "main; sys.exit(main())"] + words[1:]


def test_readme_lists_the_benchmarks() -> None:
    commands = readme_quick_commands()
    for wanted in ("python3 benchmarks/kernels.py --quick", "vllm-lite bench kernels --quick",
                   "python3 benchmarks/throughput.py --quick", "python3 benchmarks/latency.py --quick",
                   "python3 benchmarks/linear.py --quick", "python3 benchmarks/step_profile.py --quick",
                   "python3 benchmarks/elementwise.py --quick", "python3 benchmarks/sampler.py --quick"):
        assert wanted in commands, commands


def test_readme_bench_commands_run_from_a_clean_clone(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=60)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MPLCONFIGDIR=str(tmp_path / "mpl"), OMP_NUM_THREADS="1",
               VLLM_LITE_CACHE=str(tmp_path / "cache"), PYTHONDONTWRITEBYTECODE="1")
    probe = subprocess.run(
        [sys.executable, "-P", "-c", "import vllm_lite; print(vllm_lite._C is not None); "
         "print(vllm_lite.__file__)"], cwd=clone, env=env, capture_output=True, text=True,
        timeout=60)
    if probe.returncode != 0 or not probe.stdout.startswith("True"):
        pytest.skip(f"no installed vllm_lite with its compiled _C (the README's `pip install "
                    f"--no-build-isolation .`): {probe.stdout} {probe.stderr[-500:]}")
    assert not any((clone / "vllm_lite").glob("_C*")), "a clean clone has no build"

    model = tmp_path / "model"
    save_hf_model(make_config("llama"), model)
    make_tokenizer(model)  # the serving benchmark sends text
    procs = {}
    start = time.monotonic()
    for i, command in enumerate(readme_quick_commands()):
        out = tmp_path / f"out{i}"
        procs[command] = (out, subprocess.Popen(
            _argv(command) + _tiny_flags(command, model, out), cwd=clone, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failures = []
    for command, (out, proc) in procs.items():
        try:
            log = proc.communicate(timeout=max(1.0, TIMEOUT - (time.monotonic() - start)))[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
            failures.append(f"{command}: timed out\n{log[-3000:]}")
            continue
        reports = list(out.glob("*.md")) if out.is_dir() else []
        if proc.returncode != 0 or not reports or "Traceback" in log:
            failures.append(f"{command}: exit {proc.returncode}, reports {reports}\n"
                            f"{log[-3000:]}")
    assert not failures, "\n\n".join(failures)
