"""cpu_threads_bind: the CPU list's parsing and checks (ValueError naming the option), the
native op binding torch's threads one per CPU, and an engine bound that way generating the
same greedy tokens as an unbound one. Binding pins the calling process's threads, so the
binding runs in subprocesses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from entrypoints.utils import make_llm, run_python_json  # noqa: E402
from vllm_lite import SamplingParams  # noqa: E402
from vllm_lite.config import parse_cpu_ids  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux")

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def test_parse_cpu_ids() -> None:
    assert parse_cpu_ids("auto") == ALLOWED
    last = ALLOWED[-1]
    assert parse_cpu_ids(str(last)) == [last]
    assert parse_cpu_ids(f"{ALLOWED[0]}-{ALLOWED[0]}") == [ALLOWED[0]]
    if len(ALLOWED) > 1:
        assert parse_cpu_ids(f"{ALLOWED[1]},{ALLOWED[0]}") == [ALLOWED[1], ALLOWED[0]]


@pytest.mark.parametrize("bad,match", [
    ("", "must be 'auto' or a CPU list"),
    (3, "must be 'auto' or a CPU list"),
    ("x", "'x' is not a CPU number"),
    ("1-0", "'1-0' is not a CPU number or a range"),
    ("0,", "'' is not a CPU number"),
    (f"{max(ALLOWED or [0]) + 1}", "is not one this process may run on"),
    (f"{(ALLOWED or [0])[0]},{(ALLOWED or [0])[0]}", "lists a CPU twice"),
])
def test_bad_cpu_lists_are_refused(bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=f"cpu_threads_bind.*{match}"):
        parse_cpu_ids(bad)


def test_refused_with_several_ranks(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_threads_bind with tensor_parallel_size > 1"):
        make_llm(model_dir, cpu_threads_bind="auto", tensor_parallel_size=2)


def test_op_binds_threads_one_per_cpu() -> None:
    cpu = ALLOWED[-1]
    got = run_python_json(f"""
import json, os, torch, vllm_lite
from vllm_lite import ops
lines = ops.init_cpu_threads_env("{cpu}")
x = torch.randn(256, 256); y = x @ x  # a parallel region on the bound pool
try:
    ops.init_cpu_threads_env("not-a-cpu")
    err = ""
except RuntimeError as e:
    err = str(e)
print(json.dumps({{"lines": lines, "affinity": sorted(os.sched_getaffinity(0)),
                  "threads": torch.get_num_threads(), "err": err}}))
""")
    assert got["lines"] == f"thread 0 -> CPU {cpu}"
    assert got["affinity"] == [cpu] and got["threads"] == 1
    assert "cpu_ids 'not-a-cpu'" in got["err"]


def test_bound_engine_generates_as_unbound(model_dir: Path, offline: Any) -> None:
    # The bound engine in a fresh process (binding is process-wide); the unbound one is the
    # tests' own offline engine on the same checkpoint.
    prompts = [[1, 5, 9, 2], [3, 4]]
    code = """
import json, os, torch
from entrypoints.utils import make_llm
from vllm_lite import SamplingParams
from pathlib import Path
llm = make_llm(Path({folder!r}), cpu_threads_bind="auto")
outs = llm.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
print(json.dumps({{"tokens": [o.outputs[0].token_ids for o in outs],
                  "affinity": sorted(os.sched_getaffinity(0)),
                  "threads": torch.get_num_threads()}}))
"""
    bound = run_python_json(code.format(folder=str(model_dir), prompts=prompts))
    plain = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8),
                             use_tqdm=False)
    assert bound["tokens"] == [o.outputs[0].token_ids for o in plain]
    assert bound["affinity"] == [ALLOWED[0]] and bound["threads"] == len(ALLOWED)
