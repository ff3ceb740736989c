"""The CPU worker's allocator settings (vllm_lite/worker/cpu_malloc.py): with them, freed
blocks of megabytes are reused instead of being faulted in again, measured as the page
faults of a loop that allocates and frees the way a step does; a user's own glibc settings
win; an engine on the CPU applies them. Each case runs in a fresh process (the settings
are process-wide; the huge-page helpers share one)."""

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


# The VmFlags of the mapping holding an address ("hg": madvised MADV_HUGEPAGE) and its
# AnonHugePages (kB); a helper for the children below.
SMAPS = """
def mapping_of(addr):
    entry = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = {"in": lo <= addr < hi}
        elif entry is not None and entry["in"]:
            if head == "VmFlags:":
                return {"flags": line.split()[1:], "huge_kb": entry.get("huge_kb", 0)}
            if head == "AnonHugePages:":
                entry["huge_kb"] = int(line.split()[1])
    return None
"""


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


# The three helpers' checks, in one fresh process (they change no process-wide setting).
HUGE_PAGE_HELPERS = """
import json, torch
from vllm_lite.worker.cpu_malloc import (HUGE_PAGE_BYTES, advise_huge_pages,
                                         copy_to_huge_pages, empty_huge_pages)

def advise():
    t = torch.empty(64 << 20, dtype=torch.uint8)  # past glibc's mmap threshold: fresh pages
    advised = advise_huge_pages(t)
    small = advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))
    t.fill_(1)  # first touch
    m = mapping_of(t.data_ptr() + (32 << 20))
    return {"advised": advised, "small": small, "unit": HUGE_PAGE_BYTES, "flags": m["flags"],
            "huge_kb": m["huge_kb"]}

def empty():
    out = {}
    for name, shape, dtype in (("odd", (3, 1000, 777), torch.bfloat16),
                               ("tiny", (5,), torch.float32)):
        t = empty_huge_pages(shape, dtype)
        t.fill_(1)  # first touch
        first, last = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size() - 1
        out[name] = {"shape": list(t.shape), "dtype": str(t.dtype),
                     "contiguous": t.is_contiguous(), "aligned": first % HUGE_PAGE_BYTES == 0,
                     "ones": bool((t == 1).all()),
                     "hg": ["hg" in mapping_of(a)["flags"] for a in (first, last)],
                     "huge_kb": mapping_of(first)["huge_kb"]}
    return out

def copy():
    g = torch.Generator().manual_seed(7)
    ts = [torch.randn(1000, 1537, generator=g).to(torch.bfloat16),  # 3 MB, odd row length
          torch.randn(3, 5, generator=g),
          torch.randn(600, 1200, generator=g)]
    moved = copy_to_huge_pages(ts)
    small = [torch.randn(4, 4, generator=g)]
    kept = copy_to_huge_pages(small)
    return {
        "equal": [bool(torch.equal(a, b)) for a, b in zip(ts, moved)],
        "meta": [[a.dtype == b.dtype, a.shape == b.shape, b.is_contiguous()]
                 for a, b in zip(ts, moved)],
        "copies": [a.data_ptr() != b.data_ptr() for a, b in zip(ts, moved)],
        "storages": len({m.untyped_storage().data_ptr() for m in moved}),
        "aligned": [m.data_ptr() % 4096 == 0 for m in moved],
        "hg": "hg" in mapping_of(moved[0].data_ptr() + (2 << 20))["flags"],
        "small_kept": kept[0] is small[0]}

print(json.dumps({"advise": advise(), "empty": empty(), "copy": copy()}))
"""


@pytest.fixture(scope="module")
def huge_pages() -> dict:
    return _run(SMAPS + HUGE_PAGE_HELPERS)


def test_advise_huge_pages_backs_a_fresh_tensor_with_huge_pages(huge_pages: dict) -> None:
    got = huge_pages["advise"]
    # The whole 2 MiB pages inside 64 MiB: 31 or 32 of them, by the tensor's alignment.
    assert got["advised"] in (31 * got["unit"], 32 * got["unit"]), got
    assert got["small"] == 0  # holds no whole huge page
    assert "hg" in got["flags"], got
    if _thp_mode() in ("always", "madvise"):
        assert got["huge_kb"] >= 16 << 10, got  # most of the 64 MiB is in huge pages


def test_empty_huge_pages_is_advised_from_its_first_byte(huge_pages: dict) -> None:
    got = huge_pages["empty"]
    odd, tiny = got["odd"], got["tiny"]
    assert odd["shape"] == [3, 1000, 777] and odd["dtype"] == "torch.bfloat16", got
    assert tiny["shape"] == [5] and tiny["dtype"] == "torch.float32", got
    for t in (odd, tiny):
        # A plain torch.empty leaves up to 2 MiB before its first huge-page boundary
        # unadvised; this one starts on the boundary, advised to its last byte.
        assert t["contiguous"] and t["aligned"] and t["ones"] and all(t["hg"]), got
    if _thp_mode() in ("always", "madvise"):
        assert odd["huge_kb"] >= 2 << 10, got


def test_copy_to_huge_pages_copies_into_one_advised_buffer(huge_pages: dict) -> None:
    got = huge_pages["copy"]
    assert all(got["equal"]) and all(all(m) for m in got["meta"]), got
    assert all(got["copies"]) and got["storages"] == 1 and all(got["aligned"]), got
    assert got["hg"], got
    assert got["small_kept"], got  # no whole huge page to advise: the tensor itself


@pytest.fixture(scope="module")
def cpu_engine(model_dir: Path) -> dict:
    """One fresh process making a CPU engine: whether the allocator settings were applied
    before and after, and whether each layer's K and V pool starts on a huge-page boundary
    in memory advised for huge pages."""
    return _run(SMAPS + f"""
import json
from pathlib import Path
from entrypoints.utils import make_llm
from vllm_lite.worker import cpu_malloc
from vllm_lite.worker.cpu_malloc import HUGE_PAGE_BYTES
before = cpu_malloc._applied
llm = make_llm(Path({str(model_dir)!r}), kv_cache_space=0.25)
flags = []
for k, v in llm.llm_engine.cache_engine.gpu_cache:
    for t in (k, v):
        # Block 0 (the pool's first bytes) is handed out like any other.
        flags.append(t.data_ptr() % HUGE_PAGE_BYTES == 0 and "hg" in mapping_of(t.data_ptr())["flags"])
print(json.dumps({{"before": before, "after": cpu_malloc._applied, "flags": flags}}))
""")


def test_cpu_engine_applies_them(cpu_engine: dict) -> None:
    assert (cpu_engine["before"], cpu_engine["after"]) == (False, True)


def test_cpu_engine_keeps_its_kv_pool_in_huge_pages(cpu_engine: dict) -> None:
    assert cpu_engine["flags"] and all(cpu_engine["flags"]), cpu_engine


@pytest.fixture(scope="module")
def relocated(model_dir: Path) -> dict:
    """For a float and an int8 engine, made one after the other in one fresh process whose
    worker's copy_to_huge_pages records what it gets and returns clones: how many weights it
    returned, the packed projection weights (a quantized layer's qweight), whether the model
    holds exactly the returned tensors, and the tokens a short generate gave."""
    return _run(f"""
import json
from pathlib import Path
from vllm_lite import SamplingParams
from vllm_lite.models.llama import Linear
from vllm_lite.worker import worker
returned = []
def copy(ts):
    returned.extend(t.clone() for t in ts)
    return list(returned)
worker.copy_to_huge_pages = copy
from entrypoints.utils import make_llm
got = {{}}
for quantization in (None, "int8"):
    returned.clear()
    llm = make_llm(Path({str(model_dir)!r}), quantization=quantization)
    model = llm.llm_engine.executor.worker.model
    packed = [m._own_packed for m in model.modules()
              if isinstance(m, Linear) and m._own_packed is not None]
    qweights = [m.qweight for m in model.modules() if hasattr(m, "qweight")]
    packed += qweights
    out = llm.generate([{{"prompt_token_ids": [5, 6, 7, 8]}}], use_tqdm=False,
                       sampling_params=SamplingParams(max_tokens=4, temperature=0.0,
                                                      ignore_eos=True))
    got[str(quantization)] = {{
        "returned": len(returned), "packed": len(packed), "qweights": len(qweights),
        "same": all(any(p is r for r in returned) for p in packed),
        "tokens": len(out[0].outputs[0].token_ids)}}
    del llm, model, packed, qweights
print(json.dumps(got))
""")


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_cpu_worker_relocates_the_packed_weights(relocated: dict, quantization: str | None) -> None:
    """The worker hands every packed projection weight (a quantized layer's qweight) to
    copy_to_huge_pages once and the model runs on what it returns."""
    got = relocated[str(quantization)]
    assert got["returned"] == got["packed"] and got["same"], got
    assert (got["qweights"] > 0) == (quantization is not None), got
    assert got["tokens"] == 4, got
