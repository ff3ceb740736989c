"""The machine the engine runs on: its memory, CPU features and the CPUs this process may
use, and torch's thread count. Read when asked (never at import); torch is imported only by
the function that sets its threads."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable

from vllm_lite.config.schema import check_int


def total_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (/proc/cpuinfo ``flags`` on x86,
    ``Features`` on Arm); empty where it is not readable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16(flags: Iterable[str] | None = None,
                        machine: str | None = None) -> bool:
    """Whether the CPU computes bfloat16 natively: AVX512-BF16 or AMX-BF16 on x86-64, the
    BF16 extension on aarch64. Without it torch and our kernels convert every bf16 value to
    float32 and back, which makes bf16 slower than plain float32. ``flags`` / ``machine``
    default to this machine's (given in tests)."""
    have = set(cpu_flags() if flags is None else flags)
    arch = (machine or platform.machine()).lower()
    if arch in ("x86_64", "amd64", "x86", "i686"):
        return bool(have & {"avx512_bf16", "amx_bf16"})
    if arch in ("aarch64", "arm64"):
        return "bf16" in have
    return False


def parse_cpu_ids(spec: object) -> list[int]:
    """cpu_threads_bind's CPUs: "auto" (every CPU this process may run on) or a list of CPU
    numbers and ranges ("0-3,8"), each allowed to this process, no repeats. ValueError naming
    cpu_threads_bind otherwise."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if allowed is None:
        raise ValueError("cpu_threads_bind needs Linux (CPU affinity)")
    if spec == "auto":
        return allowed
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"cpu_threads_bind must be 'auto' or a CPU list such as '0-3,8', "
                         f"got {spec!r}")
    cpus: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"cpu_threads_bind {spec!r}: {part!r} is not a CPU number or a "
                             f"range a-b with a <= b")
        cpus.extend(range(int(lo), int(hi if sep else lo) + 1))
    bad = [c for c in cpus if c not in allowed]
    if bad:
        raise ValueError(f"cpu_threads_bind {spec!r}: CPU {bad[0]} is not one this process may "
                         f"run on ({_ranges(allowed)})")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_threads_bind {spec!r} lists a CPU twice")
    return cpus


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    for c in cpus:
        if out and int(out[-1].split("-")[-1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def set_threads(threads: int | None) -> None:
    """Sets torch's intra-op threads before a model loads (None: leave torch's default);
    ValueError unless a positive int."""
    if threads is None:
        return
    check_int("threads", threads, 1)
    import torch

    torch.set_num_threads(threads)
