"""Builds the SIMT emulator binary (emu_kernels) and runs test cases through it.

The binary is compiled once per source state (a hash of csrc/cuda, csrc/fp8.h,
csrc/attention_limits.h, this folder and the flags) into build/cuda_emulation/<hash>/, with AddressSanitizer and UBSan, translation
units in parallel. Its attention kernels are the instances default_kernels.txt lists (those
the default grid runs) unless the run selected a full_grid test (or CUDA_EMU_KERNELS=all):
then every instance, as the pip build has them. A case needing a kernel left out fails with
an error naming the list (the SIMT kernels), or takes the SIMT kernel where it planned the
tensor-core one, which the attention tests' path checks catch. Cases are directories with spec.txt + raw buffers (see emu_main.cpp);
run_cases() runs them in one process, and when a case crashes it (sanitizer report,
emulator error) records the report for that case and continues with the rest in a new
process.

Environment:
  CUDA_EMU_SEEDS    schedule seeds, comma-separated (default "1,2": two random schedules;
                   0 is the in-order schedule)
  CUDA_EMU_WORKERS  worker threads running blocks (default 2)
  CUDA_EMU_JOBS     parallel compiles (default 2)
  CUDA_EMU_CXX      the compiler (default g++)
  CUDA_EMU_CSRC     the csrc folder whose kernels run (default: the checkout's)
  CUDA_EMU_KERNELS  "all": every attention kernel instance, "default": default_kernels.txt
                   (default: all when the run selected a full_grid test, else default)
  CUDA_EMU_KERNEL_LOG  a file to which the emulator appends every launched kernel's symbol;
                   `python tests/cuda_emulation/harness.py kernels LOG` prints the instance
                   list they make. default_kernels.txt is that list for a default-grid run of
                   tests/cuda_emulation and tests/compat with CUDA_EMU_KERNELS=all.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# CUDA_EMU_CSRC: another csrc folder to emulate (e.g. a copy with a bug injected).
CSRC = Path(os.environ.get("CUDA_EMU_CSRC", ROOT / "csrc")).resolve()
BUILD = ROOT / "build" / "cuda_emulation"
# The kernel tables that csrc/cuda/generate_kernels.py writes (the emulator ignores the
# build options), which the kernel headers include: generated/all (every instance) or
# generated/default (the instances DEFAULT_KERNELS lists).
GENERATED = BUILD / "generated"
DEFAULT_KERNELS = HERE / "default_kernels.txt"

SOURCES = [
    "emu_runtime.cpp", "emu_tensor.cpp", "emu_main.cpp", "emu_selftest.cpp", "emu_cache.cpp",
    "emu_attention_f32.cpp", "emu_attention_f16.cpp", "emu_attention_bf16.cpp",
    "emu_attention_fp8_e4m3.cpp", "emu_attention_fp8_e5m2.cpp", "emu_varlen.cpp",
    "emu_varlen_fp8.cpp", "emu_elementwise.cpp", "emu_moe.cpp",
]
# Sources a translation unit includes besides the headers (its object depends on them).
INCLUDED = {"emu_varlen_fp8.cpp": ("emu_varlen.cpp",)}
# The translation units that include kernels from csrc/cuda (their objects depend on it).
KERNEL_TUS = ("emu_attention", "emu_varlen", "emu_cache", "emu_elementwise", "emu_moe")
# The slowest first, so two parallel jobs finish together.
SOURCES.sort(key=lambda s: not s.startswith(("emu_attention", "emu_varlen")))

SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
# -g1: line tables only. The sanitizers' stack traces still name function, file and line;
# full debug information made the kernel units' compile about 40% slower.
CXXFLAGS = [
    "-std=c++20", "-O1", "-g1", "-fno-omit-frame-pointer", "-fno-strict-aliasing",
    "-Wall", "-Wno-unknown-pragmas", *SANITIZE,
    f"-I{HERE / 'fake_include'}", f"-I{HERE}", f"-I{CSRC}",
]
# -rdynamic: the kernels' symbols visible to dladdr (CUDA_EMU_KERNEL_LOG).
LDFLAGS = [*SANITIZE, "-pthread", "-rdynamic"]
RUN_ENV = {
    # Leak checking needs ptrace-like privileges and is irrelevant here; abort on the first
    # report so the harness sees a crash.
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:allocator_may_return_null=0",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}


def seeds() -> list[int]:
    return [int(s) for s in os.environ.get("CUDA_EMU_SEEDS", "1,2").split(",") if s.strip()]


def seed_params() -> list:
    """The schedule seeds as test parameters: the first runs by default, the others are
    part of the full grid (pytest --full-grid)."""
    return [pytest.param(s, id=f"sched{s}", marks=() if i == 0 else pytest.mark.full_grid)
            for i, s in enumerate(seeds())]


def selected(request: pytest.FixtureRequest, name: str) -> set:
    """The values (a case's id, else the value) that parameter `name` takes in the tests of
    the requesting module that this run selected: a module's fixture runs only those cases
    and seeds in the emulator."""
    found = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and name in params:
            found.add(getattr(params[name], "id", params[name]))
    return found


def cxx() -> str:
    return os.environ.get("CUDA_EMU_CXX", "g++")


_EVERY_KERNEL = False


def use_every_kernel(session: pytest.Session) -> None:
    """Called by the emulated tests' session fixtures: the binary gets every attention
    kernel instance when the run selected a full_grid test, else DEFAULT_KERNELS's."""
    global _EVERY_KERNEL
    _EVERY_KERNEL = any(it.get_closest_marker("full_grid") for it in session.items)


def every_kernel() -> bool:
    choice = os.environ.get("CUDA_EMU_KERNELS", "")
    if choice not in ("", "all", "default"):
        raise ValueError(f"CUDA_EMU_KERNELS must be 'all' or 'default', got {choice!r}")
    return choice == "all" or (not choice and _EVERY_KERNEL)


def generated_dir() -> Path:
    return GENERATED / ("all" if every_kernel() else "default")


def cxxflags() -> list[str]:
    return [*CXXFLAGS, f"-I{generated_dir()}"]


class Unavailable(Exception):
    """The emulator cannot be built on this machine (the tests skip with this reason)."""


def _hash_files(h, files) -> None:
    for f in sorted(files):
        if f.is_file():
            h.update(str(f).encode())
            h.update(f.read_bytes())


def _object_key(src: str) -> str:
    """Hash of what one translation unit's object depends on: its source, the emulator's
    headers, the kernels (for the TUs that include them), flags and compiler."""
    h = hashlib.sha256()
    _hash_files(h, [HERE / src, *HERE.rglob("*.h"), *(HERE / s for s in INCLUDED.get(src, ()))])
    if not every_kernel():
        _hash_files(h, [DEFAULT_KERNELS])
    if src.startswith(KERNEL_TUS) or src in ("emu_main.cpp", "emu_selftest.cpp"):
        # The kernels, the limits they share with the CPU side (csrc/attention_limits.h) and
        # the fp8 conversions (csrc/fp8.h, through cuda/dtype.cuh; emu_main.cpp includes it
        # for the cache element types).
        # The generator is under csrc/cuda: its tables are hashed with the kernels.
        _hash_files(h, [*(CSRC / "cuda").rglob("*"), CSRC / "attention_limits.h",
                        CSRC / "moe_limits.h", CSRC / "fp8.h"])
    h.update(" ".join(cxxflags()).encode())
    h.update(_compiler_version().encode())
    return h.hexdigest()[:16]


_VERSION: str | None = None


def _compiler_version() -> str:
    global _VERSION
    if _VERSION is None:
        try:
            _VERSION = subprocess.run([cxx(), "--version"], capture_output=True,
                                      text=True).stdout
        except OSError:
            _VERSION = ""
    return _VERSION


def _check_toolchain() -> None:
    if shutil.which(cxx()) is None:
        raise Unavailable(f"no C++ compiler ({cxx()}) on PATH: the CUDA emulation tests need g++")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "t.cpp"
        src.write_text("#include <ucontext.h>\nint main() { ucontext_t c; return getcontext(&c); }\n")
        r = subprocess.run([cxx(), *SANITIZE, str(src), "-o", str(Path(d) / "t")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise Unavailable(f"{cxx()} cannot build with -fsanitize=address,undefined "
                              f"(libasan / libubsan missing?): {r.stderr.strip()[:300]}")


def _generate_tables() -> None:
    """Runs the kernel generator for every kernel or the default list (its tables only are
    used here)."""
    only = [] if every_kernel() else ["--instances", str(DEFAULT_KERNELS)]
    r = subprocess.run([sys.executable, str(CSRC / "cuda" / "generate_kernels.py"),
                        str(generated_dir()), "--head-sizes", "all", "--kv-cache-dtypes", "all",
                        *only], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"generate_kernels.py failed:\n{r.stderr[-4000:]}")


_BINARY: dict[bool, Path] = {}
_ERROR: str | None = None


def binary() -> Path:
    """The emulator binary, built if this source state has none yet."""
    global _ERROR
    if every_kernel() in _BINARY:
        return _BINARY[every_kernel()]
    if _ERROR is not None:
        raise Unavailable(_ERROR)
    try:
        _BINARY[every_kernel()] = _build()
    except Unavailable as e:
        _ERROR = str(e)
        raise
    return _BINARY[every_kernel()]


def _build() -> Path:
    """Objects are cached per translation unit (build/cuda_emulation/obj/<stem>-<key>.o),
    the executable per set of objects."""
    keys = {src: _object_key(src) for src in SOURCES}
    objdir = BUILD / "obj"
    objs = [objdir / f"{Path(src).stem}-{keys[src]}.o" for src in SOURCES]
    exe_key = hashlib.sha256(("".join(sorted(keys.values())) + " ".join(LDFLAGS)).encode()
                             ).hexdigest()[:16]
    exe = BUILD / exe_key / "emu_kernels"
    if exe.exists():
        return exe
    _check_toolchain()
    objdir.mkdir(parents=True, exist_ok=True)
    exe.parent.mkdir(parents=True, exist_ok=True)
    with open(BUILD / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same state
        if exe.exists():
            return exe
        _generate_tables()
        jobs = max(1, int(os.environ.get("CUDA_EMU_JOBS", "2")))
        pending = [(src, obj) for src, obj in zip(SOURCES, objs) if not obj.exists()]
        running: list[tuple[str, Path, subprocess.Popen]] = []
        failed = []
        while pending or running:
            while pending and len(running) < jobs:
                src, obj = pending.pop(0)
                tmp = obj.with_suffix(".tmp.o")
                cmd = ["nice", "-n", "10", cxx(), *cxxflags(), "-c", str(HERE / src), "-o",
                       str(tmp)]
                running.append((src, obj, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                           stderr=subprocess.STDOUT, text=True)))
            src, obj, p = running.pop(0)
            log, _ = p.communicate()
            if p.returncode != 0:
                failed.append(f"{src}:\n{log[-4000:]}")
            else:
                obj.with_suffix(".tmp.o").rename(obj)
        if failed:
            raise RuntimeError("building the CUDA emulator failed:\n" + "\n".join(failed))
        tmp = exe.with_suffix(".tmp")
        r = subprocess.run([cxx(), *map(str, objs), *LDFLAGS, "-o", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"linking the CUDA emulator failed:\n{r.stderr[-4000:]}")
        tmp.rename(exe)
    return exe


# ---------------------------------------------------------------------------------------
# Cases


@dataclass
class CaseDir:
    """One case: spec.txt with scalar arguments and buffers (raw files)."""

    path: Path
    lines: list[str] = field(default_factory=list)
    outs: list[str] = field(default_factory=list)

    def set(self, **kv) -> None:
        for k, v in kv.items():
            if isinstance(v, float):
                v = repr(v)
            self.lines.append(f"{k} {v}")

    def buf(self, name: str, t: torch.Tensor | np.ndarray, offset: int = 0,
            out: bool = False) -> None:
        """Stores t's bytes (a tensor: its contiguous data) as buffer `name`."""
        data = t if isinstance(t, np.ndarray) else _tensor_bytes(t)
        (self.path / f"{name}.in").write_bytes(data.tobytes())
        self.lines.append(f"buf {name} {name}.in {offset}")
        if out:
            self.lines.append(f"out {name}")

    def write(self) -> None:
        (self.path / "spec.txt").write_text("\n".join(self.lines) + "\n")

    def read(self, name: str, seed: int, like: torch.Tensor) -> torch.Tensor:
        """Buffer `name` after the run with `seed`, with like's dtype and shape."""
        raw = np.fromfile(self.path / f"{name}.s{seed}.bin", dtype=np.uint8)
        t = torch.from_numpy(raw.copy()).view(like.dtype)
        return t.reshape(like.shape)


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def storage_of(view: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the whole storage a view reads, as a flat tensor of its dtype; the view's element
    offset into it), so the emulator allocates exactly what the view can reach."""
    n = view.untyped_storage().nbytes() // view.element_size()
    flat = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage(), 0, (n,), (1,))
    return flat, view.storage_offset()


@dataclass
class Result:
    ok: bool
    message: str = ""


def run_cases(dirs: list[Path], seed_list: list[int] | None = None,
              timeout: float = 900) -> dict[Path, Result]:
    """Runs every case under every seed; a crashed case gets the crash report, and the
    remaining cases run in a fresh process."""
    exe = binary()
    seed_list = seeds() if seed_list is None else seed_list
    env = {**os.environ, **RUN_ENV}
    results: dict[Path, Result] = {}
    todo = [Path(d) for d in dirs]
    while todo:
        p = subprocess.run([str(exe), ",".join(map(str, seed_list)), *map(str, todo)],
                           capture_output=True, text=True, env=env, timeout=timeout)
        started = None
        for line in p.stdout.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "CASE_START":
                started = Path(rest)
            elif kind == "CASE_DONE":
                results[Path(rest)] = Result(True)
                started = None
            elif kind == "CASE_ERROR":
                d, _, msg = rest.partition(" ")
                results[Path(d)] = Result(False, f"launcher error: {msg}")
                started = None
        if started is not None or p.returncode != 0:
            report = _summarize(p.stderr)
            if started is None:  # died before any case started
                for d in todo:
                    results.setdefault(d, Result(False, f"emulator exited with {p.returncode}: {report}"))
                break
            results[started] = Result(False, f"emulator crashed (exit {p.returncode}): {report}")
        todo = [d for d in todo if d not in results]
    return results


def _summarize(stderr: str, limit: int = 6000) -> str:
    """The sanitizer / emulator report, most informative lines first."""
    lines = stderr.splitlines()
    keys = ("CUDA_EMU ERROR", "ERROR: AddressSanitizer", "runtime error", "SUMMARY:",
            "READ of size", "WRITE of size", "is located", "#0 ", "#1 ", "#2 ", "#3 ")
    head = [ln for ln in lines if any(k in ln for k in keys)][:30]
    text = "\n".join(head) if head else stderr
    return text[:limit]


# ---------------------------------------------------------------------------------------
# The kernel list (default_kernels.txt) from a CUDA_EMU_KERNEL_LOG file

# Kernel template -> its name in csrc/cuda/generate_kernels.py.
_KERNEL_NAMES = {"paged_attention_kernel": "paged_attention",
                 "paged_attention_tc_kernel": "paged_attention_tc",
                 "varlen_paged_attention_kernel": "varlen_attention",
                 "varlen_paged_attention_tc_kernel": "varlen_attention_tc"}
_QUERY_TAGS = {"float": "f32", "__half": "f16", "__nv_bfloat16": "bf16"}
# The fp8 cache elements as c++filt names them (fp8_e4m3 / fp8_e5m2 are aliases).
_FP8_CACHES = {"vllm_lite::cuda::fp8_t<vllm_lite::fp8::E4M3>": "fp8_e4m3",
               "vllm_lite::cuda::fp8_t<vllm_lite::fp8::E5M2>": "fp8_e5m2"}


def kernel_list(symbols: list[str]) -> list[str]:
    """The generator's instance lines (see its --instances) of the attention kernels among
    the logged symbols (mangled), sorted; other kernels are not in the list."""
    names = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True,
                           text=True, check=True).stdout.splitlines()
    lines = set()
    for name in names:
        m = re.match(r"void vllm_lite::cuda::\w+::(\w+)<(.*)>\([^()]*\)$", name)
        if m is None or m.group(1) not in _KERNEL_NAMES:
            continue
        kernel = _KERNEL_NAMES[m.group(1)]
        args = [a.strip() for a in re.split(r",(?![^<]*>)", m.group(2))]
        cache = "auto" if args[1] == args[0] else _FP8_CACHES[args[1]]
        bs = args[2] if kernel.startswith("paged") else "-"
        lines.add(f"{kernel} {_QUERY_TAGS[args[0]]} {cache} {bs} {args[-1]}")
    return sorted(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "kernels":
        sys.exit("usage: python tests/cuda_emulation/harness.py kernels CUDA_EMU_KERNEL_LOG")
    print("\n".join(kernel_list(Path(sys.argv[2]).read_text().split())))
