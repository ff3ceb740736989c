"""Decode-attention kernel benchmark: vllm_lite paged attention v1/v2 against its peers.

For every (dtype, heads, batch, context) it builds, from one randomly filled KV pool in
vllm_lite's paged layout (>= --pool-gib GiB, block tables drawn from a shuffled
permutation of the pool so consecutive logical blocks lie far apart), and times on the
very same K/V values:

  v1, v2        torch.ops.vllm_lite.paged_attention_v1 / _v2 (preallocated out/scratch)
  sdpa          torch SDPA on a contiguous [batch, kv_heads, ctx, head] copy of the KV
                (flash backend forced; enable_gqa=True for GQA), the copy made once,
                outside timing
  gather+sdpa   index_select of the sequence's blocks from the pool into a preallocated
                staging buffer, a transposing copy into [batch, kv_heads, ctx, head], then
                SDPA (all timed)
  flash_attn    flash_attn_with_kvcache with a block table over pages of 256 tokens
                (CUDA only, when the flash_attn package imports)

--kv-cache-dtypes fp8 (= fp8_e4m3) / fp8_e5m2 rows: the pool holds fp8 bytes (key / 0.5,
value / 2: scales != 1) and v1 / v2 read them with kv_cache_dtype and the scales; the peers
have no fp8 KV input and run on the dequantized values in the query dtype (gather+SDPA
converts in its timed gather). Each kernel's bandwidth counts the bytes it reads (1 per
element for v1 / v2 on fp8, 2 for the peers), and an fp8 row also gives the time of the
same shape's 16-bit-cache row / its own (the fp8 speedup) when both ran.

Before timing, every kernel's output is checked against a float32 reference on the first
and last sequence; a kernel that disagrees is reported as WRONG and not timed.

Each timed call starts with a cold last-level cache (a buffer of twice its size is read
on the CPU, zeroed on CUDA, between calls) unless the KV read is itself much larger than
that cache. Time is the median of the calls, after a warmup (CPU: time.perf_counter
around each call; CUDA: CUDA events). Achieved bandwidth = bytes of KV read
(batch * ctx * kv_heads * head * 2 * element size) / time, also given as a fraction of
the machine's copy bandwidth, measured in the same run (best of several copies of a
--bandwidth-gib (1 GiB) tensor into another, bytes read + written / time).

Prints a markdown table and writes <out>/kernels_<device>_<timestamp>.md and .json.

    python3 benchmarks/kernels.py --quick                      # a few shapes, ~2-3 min on 2 cores
    vllm-lite bench kernels --quick                       # the same
    python3 benchmarks/kernels.py --device cuda                # the CUDA target grid
    python3 benchmarks/kernels.py --contexts 1024 4096 --batches 1 8 32
    python3 benchmarks/kernels.py --prefill --heads 9/3x64 32/8x128   # prefill: see prefill_kernels.py
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/kernels.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import datetime as _dt
import json
import logging
import math
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from . import RESULTS_DIR, prefill_kernels
from vllm_lite.config import KV_CACHE_DTYPES, KV_CACHE_LAYOUTS, THREADS_HELP, EngineArgs

log = logging.getLogger("bench.kernels")

DEFAULT_OUT = RESULTS_DIR
GIB = 1 << 30
MIB = 1 << 20

# "num_heads/num_kv_heads x head_size"; SmolLM2 (135M) is 9/3x64.
HEAD_ALIASES = {"smollm2": "9/3x64", "llama": "32/32x128", "gqa": "32/8x128"}
# CUDA adds a GQA group of 4 (28/4x128), a shape of the tensor-core kernel's targets.
DEFAULT_HEADS = {"cpu": ["32/32x128", "32/8x128", "9/3x64"],
                 "cuda": ["32/32x128", "32/8x128", "28/4x128", "9/3x64"]}
DEFAULT_BATCHES = [1, 8, 32, 64]
DEFAULT_CONTEXTS = [512, 1024, 4096, 16384]
DEFAULT_DTYPES = {"cpu": ["bf16", "fp32"], "cuda": ["fp16", "bf16"]}
QUICK = {
    "batches": [1, 8],
    "contexts": [1024, 4096],
    "heads": ["9/3x64", "32/8x128"],
    "dtypes": {"cpu": ["bf16"], "cuda": ["fp16"]},
}
DTYPE_NAMES = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# Largest |kernel - reference| / max|reference| accepted (reference: float32 math on the
# same rounded values). A wrong block, head or partition gives errors of order 1.
REL_TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}
# fp8 pools hold key / FP8_SCALES[0] and value / FP8_SCALES[1] (powers of two: the
# dequantized copies of the peers are exact).
FP8_SCALES = (0.5, 2.0)
KERNELS = ["v1", "v2", "sdpa", "gather_sdpa", "flash_attn"]
KERNEL_TITLES = {
    "v1": "paged v1",
    "v2": "paged v2",
    "sdpa": "SDPA contiguous",
    "gather_sdpa": "gather+SDPA",
    "flash_attn": "flash_attn kvcache",
}


# --------------------------------------------------------------------------------------
# Command line. (Importing vllm_lite imports torch, so the thread count takes effect
# through torch.set_num_threads in run_args, not through OMP_NUM_THREADS.)


EPILOG = ("Heads are written q_heads/kv_heads x head_size, e.g. 32/8x128; aliases: "
          + ", ".join(f"{k}={v}" for k, v in HEAD_ALIASES.items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/kernels.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return finish_args(args)
    except ValueError as e:
        p.error(str(e))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true",
                   help="a few shapes: batch 1/8 x ctx 1024/4096, heads 9/3x64 and 32/8x128, "
                   "bf16 on CPU / fp16 on CUDA (explicit options still override)")
    p.add_argument("--dtypes", nargs="+", help="default: bf16 fp32 on CPU, fp16 bf16 on CUDA")
    p.add_argument("--batches", nargs="+", type=int, help=f"default: {DEFAULT_BATCHES}")
    p.add_argument("--contexts", nargs="+", type=int, help=f"default: {DEFAULT_CONTEXTS}")
    p.add_argument("--heads", nargs="+",
                   help="q/kv x head, comma or space separated; default: "
                   + " ".join(DEFAULT_HEADS["cpu"]) + " on CPU, "
                   + " ".join(DEFAULT_HEADS["cuda"]) + " on CUDA")
    p.add_argument("--block-size", type=int, default=EngineArgs.block_size,
                   help="tokens per KV block of the paged pools (default: %(default)s, the "
                        "engine's)")
    p.add_argument("--kv-cache-dtypes", nargs="+", choices=KV_CACHE_DTYPES,
                   default=[EngineArgs.kv_cache_dtype],
                   help="what the KV pools store: auto (the query dtype), fp8 (= fp8_e4m3), "
                        "fp8_e5m2; each is a row per shape (default: %(default)s)")
    p.add_argument("--kv-cache-layout", choices=KV_CACHE_LAYOUTS,
                   default=EngineArgs.kv_cache_layout,
                   help="the pool's layout: split (vLLM's paged) or flash ([block, token, "
                        "kv head, dim]); the kernels read either")
    p.add_argument("--pool-gib", type=float, default=2.0,
                   help="minimum size of each KV pool (K + V), GiB; grows to the largest shape")
    p.add_argument("--mem-gib", type=float, default=None,
                   help="memory the benchmark may use (pool + contiguous copy + buffers); "
                   "default: 75%% of MemAvailable on CPU, 85%% of free GPU memory on CUDA")
    p.add_argument("--cpu-isa", default=None,
                   help="CPU kernel build to use (vllm_lite.ops.set_cpu_isa: amxbf16, avx512bf16, "
                   "avx512, avx2, generic); default: the one loaded")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    p.add_argument("--target-s", type=float, default=None,
                   help="timed seconds aimed at per kernel and shape (default 0.4, quick 0.2)")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-flush", action="store_true",
                   help="do not evict the last-level cache between timed calls")
    p.add_argument("--deadline-min", type=float, default=None,
                   help="start no new shape after this many minutes; the rest is reported "
                   "as not run")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (pools, shapes run and skipped) and exit")
    p.add_argument("--bandwidth-gib", type=float, default=1.0,
                   help="size of the copy-bandwidth probe (the reference for every row's "
                        "fraction), GiB (default: %(default)s)")
    p.add_argument("--goal-copy-bw", type=float, default=None, metavar="FRACTION",
                   help="report whether each row's paged kernel reaches FRACTION of copy "
                        "bandwidth (default: no goal; the project's goals are in "
                        "docs/design/benchmarks.md)")
    p.add_argument("--goal-fp8-speedup", type=float, default=None, metavar="RATIO",
                   help="report whether each fp8-cache row's paged kernel is at least RATIO x "
                        "faster than on the same shape's 16-bit cache (default: no goal)")
    p.add_argument("--goal-vs-sdpa", type=float, default=None, metavar="RATIO",
                   help="report whether each row's paged kernel takes at most RATIO x SDPA's "
                        "time on the contiguous cache (default: no goal)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true")
    prefill_kernels.add_arguments(p)


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the grid left unset (default or --quick) and checks it (ValueError)."""
    args.dtypes = args.dtypes or (QUICK["dtypes"] if args.quick else DEFAULT_DTYPES)[args.device]
    args.batches = args.batches or (QUICK["batches"] if args.quick else DEFAULT_BATCHES)
    args.contexts = args.contexts or (QUICK["contexts"] if args.quick else DEFAULT_CONTEXTS)
    heads = args.heads or (QUICK["heads"] if args.quick else DEFAULT_HEADS[args.device])
    args.heads = [h for item in heads for h in item.split(",") if h]
    for name in ("goal_copy_bw", "goal_vs_sdpa", "goal_fp8_speedup"):
        value = getattr(args, name)
        if value is not None and not 0 < value < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if not 0 < args.bandwidth_gib < math.inf:
        raise ValueError(f"--bandwidth-gib must be a positive number, got {args.bandwidth_gib}")
    if args.target_s is None:
        args.target_s = 0.2 if args.quick else 0.4
    try:
        args.dtypes = [DTYPE_NAMES[d.lower()] for d in args.dtypes]
        args.head_cfgs = [parse_heads(h) for h in args.heads]
    except (KeyError, ValueError) as e:
        raise ValueError(f"bad --dtypes/--heads value: {e}") from None
    if args.device == "cpu" and "float16" in args.dtypes:
        log.warning("fp16 on CPU: SDPA and the CPU kernels may be slow or unsupported")
    return args


@dataclass(frozen=True)
class Heads:
    q: int
    kv: int
    size: int

    @property
    def name(self) -> str:
        return f"{self.q}/{self.kv}x{self.size}"


def parse_heads(s: str) -> Heads:
    s = HEAD_ALIASES.get(s.lower(), s)
    qkv, size = s.lower().split("x")
    q, kv = qkv.split("/") if "/" in qkv else (qkv, qkv)
    h = Heads(int(q), int(kv), int(size))
    if h.q % h.kv:
        raise ValueError(f"{s}: query heads must be a multiple of kv heads")
    return h


# --------------------------------------------------------------------------------------
# Machine information and bandwidth


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llc_bytes_cpu() -> int:
    """Largest CPU cache (L3 on most machines) from sysfs; 64 MiB when unknown."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in base.glob("index*"):
        try:
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        num = size[:-1] if size[-1:] in "KMG" else size
        try:
            best = max(best, int(num) * mult)
        except ValueError:
            pass
    return best or 64 * MIB


def mem_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GIB


class Timer:
    """Per-call timing with a cold last-level cache; median of the calls."""

    def __init__(self, torch: Any, device: str, flush_bytes: int, args: argparse.Namespace):
        self.torch = torch
        self.device = device
        self.args = args
        self.flush_bytes = flush_bytes
        self.flush_buf = None
        self.cpu_s = self.wall_s = 0.0
        self.last_cpu_share: float | None = None
        if flush_bytes:
            n = flush_bytes // 4
            if device == "cuda":
                self.flush_buf = torch.empty(n, dtype=torch.float32, device="cuda")
            else:
                self.flush_buf = torch.ones(n, dtype=torch.float32)  # touched: real pages

    def flush(self) -> None:
        if self.flush_buf is None:
            return
        if self.device == "cuda":
            self.flush_buf.zero_()
        else:
            self.flush_buf.sum()  # reads: leaves clean lines, no write-back in the timed call

    def one(self, fn: Callable[[], Any], flush: bool) -> float:
        """Seconds of one call."""
        torch = self.torch
        if flush:
            self.flush()
        if self.device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        self.cpu_s += time.process_time() - c0
        self.wall_s += dt
        return dt

    def measure(self, fn: Callable[[], Any], flush: bool) -> tuple[float, int]:
        """(median seconds, calls timed)."""
        a = self.args
        est = min(self.one(fn, flush) for _ in range(max(1, a.warmup)))
        iters = int(min(a.max_iters, max(a.min_iters, math.ceil(a.target_s / max(est, 1e-7)))))
        times = []
        self.cpu_s = self.wall_s = 0.0
        if self.device == "cuda" and flush:
            # Queue every call with its own flush and events, then synchronize once.
            torch = self.torch
            evs = []
            for _ in range(iters):
                self.flush()
                s = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                evs.append((s, e))
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) / 1e3 for s, e in evs]
        else:
            times = [self.one(fn, flush) for _ in range(iters)]
        self.last_min = min(times)
        # CPU time of all our threads / (wall time x threads): well under 1 when other
        # processes took our cores (or when the kernel's threads sleep at barriers).
        self.last_cpu_share = (self.cpu_s / (self.wall_s * self.torch.get_num_threads())
                               if self.device == "cpu" and self.wall_s > 0 else None)
        return statistics.median(times), iters


def copy_bandwidth(torch: Any, device: str, nbytes: int = GIB, reps: int = 5) -> dict[str, float]:
    """Best-of-reps copy bandwidth (bytes read + written / s) and read bandwidth (sum)."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.zeros(n, dtype=torch.float32, device=device)  # touched: no page faults
    timer = Timer(torch, device, 0, argparse.Namespace(warmup=1, min_iters=reps, max_iters=reps,
                                                       target_s=0.0))
    copy_t = min(timer.one(lambda: dst.copy_(src), False) for _ in range(reps + 1))
    read_t = min(timer.one(lambda: src.sum(), False) for _ in range(reps + 1))
    return {"copy_GBps": 2 * nbytes / copy_t / 1e9, "read_GBps": nbytes / read_t / 1e9,
            "bytes": nbytes}


# --------------------------------------------------------------------------------------
# Shapes, pools and inputs


@dataclass
class Shape:
    dtype: str
    heads: Heads
    batch: int
    ctx: int
    kv: str = "auto"  # kv_cache_dtype of the pool

    def kv_bytes(self, elem: int) -> int:
        return self.batch * self.ctx * self.heads.kv * self.heads.size * 2 * elem

    @property
    def key(self) -> tuple:
        return (SHORT_DTYPE[self.dtype], self.kv, self.heads.name, self.batch, self.ctx)


def fill_random_(torch: Any, t: Any, gen: Any, chunk_elems: int = 16 * MIB) -> None:
    """Fills t with N(0, 1) values. On the CPU, randn of a whole 2 GiB pool takes ~10 s on
    two cores, so a 16 Mi-element random chunk is copied in, rotated by a random offset
    per chunk: blocks still hold distinct values, at memcpy speed."""
    flat = t.view(-1)
    if t.device.type == "cuda" or flat.numel() <= chunk_elems:
        flat.normal_(generator=gen if t.device.type == "cpu" else None)
        return
    src = torch.randn(chunk_elems, generator=gen, dtype=torch.float32).to(t.dtype)
    offs = torch.randint(0, chunk_elems, (flat.numel() // chunk_elems + 1,), generator=gen).tolist()
    for i, start in enumerate(range(0, flat.numel(), chunk_elems)):
        n = min(chunk_elems, flat.numel() - start)
        s = offs[i]
        first = min(n, chunk_elems - s)
        flat[start:start + first].copy_(src[s:s + first])
        if n > first:
            flat[start + first:start + n].copy_(src[:n - first])


def fill_fp8_(torch: Any, t: Any, fp8: Any, scale: float, gen: Any,
              chunk_elems: int = 16 * MIB) -> None:
    """Fills the uint8 cache t with the fp8 bytes of N(0, 1) / scale (so the cache read
    with that scale holds N(0, 1) values), a chunk of random values at a time."""
    flat = t.view(-1)
    src = (torch.randn(min(chunk_elems, flat.numel()), generator=gen) / scale).to(fp8)
    src = src.view(torch.uint8).to(t.device)
    offs = torch.randint(0, src.numel(), (flat.numel() // src.numel() + 1,), generator=gen).tolist()
    for i, start in enumerate(range(0, flat.numel(), src.numel())):
        n = min(src.numel(), flat.numel() - start)
        rolled = torch.roll(src, offs[i])[:n]
        flat[start:start + n].copy_(rolled)


class Bench:
    def __init__(self, args: argparse.Namespace):
        import torch
        import torch.nn.functional as F

        self.torch = torch
        self.F = F
        self.args = args
        self.device = args.device
        self.dev = torch.device(args.device)
        self.gen = torch.Generator().manual_seed(args.seed)
        self.notes: list[str] = []
        self.rows: list[dict[str, Any]] = []
        self.pools: list[dict[str, Any]] = []
        self.bw_samples: list[float] = []
        self.copy_bw: dict[str, float] = {}

        from vllm_lite import ops  # checked importable in main()

        self.ops = ops
        if args.cpu_isa:
            ops.set_cpu_isa(args.cpu_isa)  # ValueError if this CPU cannot run it
        self.sdpa_gqa = _sdpa_has_enable_gqa(torch)
        if not self.sdpa_gqa:
            self.notes.append("torch SDPA lacks enable_gqa: GQA K/V expanded to all heads "
                              "outside timing (SDPA then reads kv_heads/heads more bytes)")
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.sdpa_kernel, self.SDPBackend = sdpa_kernel, SDPBackend
        except ImportError:
            self.sdpa_kernel = self.SDPBackend = None
        self.flash_attn = None
        self.flash_note = "n/a (flash_attn not installed)"
        if self.device == "cpu":
            self.flash_note = "n/a (flash_attn is CUDA-only)"
        else:
            try:
                from flash_attn import flash_attn_with_kvcache

                self.flash_attn = flash_attn_with_kvcache
                import flash_attn

                self.flash_note = f"flash_attn {getattr(flash_attn, '__version__', '?')}"
            except Exception as e:  # ImportError, or a broken build raising OSError
                self.flash_note = f"n/a (flash_attn not installed: {type(e).__name__})"

        if self.device == "cuda":
            props = torch.cuda.get_device_properties(0)
            self.llc = int(getattr(props, "L2_cache_size", 0) or 50 * MIB)
            free, total = torch.cuda.mem_get_info()
            self.mem_budget = int(args.mem_gib * GIB) if args.mem_gib else int(free * 0.85)
        else:
            self.llc = llc_bytes_cpu()
            avail = mem_available_bytes()
            self.mem_budget = int(args.mem_gib * GIB) if args.mem_gib else int(avail * 0.75)
        flush_bytes = 0 if args.no_flush else max(2 * self.llc, 64 * MIB)
        self.timer = Timer(torch, self.device, flush_bytes, args)
        self.t_start = time.monotonic()
        self.load_start = _loadavg()
        if self.device == "cpu" and self.load_start > 0.5:
            log.warning("load average %.1f before the run: other processes compete for the "
                        "%d cores and CPU timings will be noisy", self.load_start, os.cpu_count())

    # ---- planning --------------------------------------------------------------------

    def elem(self, dtype: str) -> int:
        return self.torch.empty((), dtype=getattr(self.torch, dtype)).element_size()

    def cache_elem(self, dtype: str, kv_dtype: str) -> int:
        """Bytes of one cache element: the query dtype's, or 1 for fp8."""
        return self.elem(dtype) if kv_dtype == "auto" else 1

    def need_bytes(self, s: Shape) -> int:
        """Memory a shape needs besides the pool: contiguous copy + staging (+ flash pages)."""
        kv = s.kv_bytes(self.elem(s.dtype))
        need = kv + kv // 2  # contiguous K and V; one staging buffer reused for K then V
        if self.flash_attn is not None:
            need += max(kv, int(self.args.pool_gib * GIB))  # flash_attn's own paged pool
        return need + kv // 4  # outputs, reference, slack

    def plan(self) -> list[tuple[str, str, Heads, int, list[Shape], list[tuple[Shape, str]]]]:
        """Per (dtype, kv cache dtype, heads): pool bytes, shapes to run, shapes skipped
        (with reason)."""
        a = self.args
        groups = []
        # Cache dtypes innermost: a run cut short by --deadline-min still pairs fp8 rows
        # with their 16-bit-cache rows.
        for dtype, heads, kv_dtype in [(d, h, k) for d in a.dtypes for h in a.head_cfgs
                                       for k in a.kv_cache_dtypes]:
            shapes = [Shape(dtype, heads, b, c, kv_dtype) for c in a.contexts
                      for b in a.batches]
            elem = self.cache_elem(dtype, kv_dtype)
            pool_min = int(a.pool_gib * GIB)
            run, skip = [], []
            for s in shapes:
                kv = s.kv_bytes(elem)
                total = max(pool_min, kv) + self.need_bytes(s)
                if total > self.mem_budget:
                    skip.append((s, f"skipped: needs {total / GIB:.1f} GiB (pool + "
                                    f"contiguous copy + buffers) > budget "
                                    f"{self.mem_budget / GIB:.1f} GiB"))
                else:
                    run.append(s)
            pool = max([pool_min] + [s.kv_bytes(elem) for s in run])
            run.sort(key=lambda s: (s.ctx, s.batch))
            groups.append((dtype, kv_dtype, heads, pool, run, skip))
        return groups

    # ---- pool and per-shape inputs ---------------------------------------------------

    def make_pool(self, dtype: str, kv_dtype: str, heads: Heads, pool_bytes: int) -> dict[str, Any]:
        torch, ops = self.torch, self.ops
        tdt = ops.kv_cache_storage_dtype(kv_dtype, getattr(torch, dtype))
        bs = self.args.block_size
        block_bytes = 2 * heads.kv * heads.size * bs * self.cache_elem(dtype, kv_dtype)
        num_blocks = max(1, math.ceil(pool_bytes / block_bytes))
        kshape, vshape = ops.kv_cache_shapes(num_blocks, heads.kv, heads.size, bs, tdt,
                                             self.args.kv_cache_layout)
        t0 = time.perf_counter()
        if self.device == "cpu":  # as the engine's CPU pools (worker/cache_engine.py)
            from vllm_lite.worker.cpu_malloc import empty_huge_pages
            kc, vc = empty_huge_pages(kshape, tdt), empty_huge_pages(vshape, tdt)
        else:
            kc = torch.empty(kshape, dtype=tdt, device=self.dev)
            vc = torch.empty(vshape, dtype=tdt, device=self.dev)
        if kv_dtype == "auto":
            fill_random_(torch, kc, self.gen)
            fill_random_(torch, vc, self.gen)
        else:
            fill_fp8_(torch, kc, ops.fp8_cache_dtype(kv_dtype), FP8_SCALES[0], self.gen)
            fill_fp8_(torch, vc, ops.fp8_cache_dtype(kv_dtype), FP8_SCALES[1], self.gen)
        if self.device == "cuda":
            torch.cuda.synchronize()
        info = {"dtype": SHORT_DTYPE[dtype], "kv_cache_dtype": kv_dtype, "heads": heads.name,
                "num_blocks": num_blocks,
                "block_size": bs, "layout": self.args.kv_cache_layout,
                "GiB": num_blocks * block_bytes / GIB,
                "fill_s": round(time.perf_counter() - t0, 2)}
        log.info("pool %s (cache %s) %s: %d blocks of %d tokens, %.2f GiB (filled in %.1f s)",
                 info["dtype"], kv_dtype, heads.name, num_blocks, bs, info["GiB"],
                 info["fill_s"])
        self.pools.append(info)
        return {"k": kc, "v": vc, "num_blocks": num_blocks, "info": info, "kv": kv_dtype}

    def gather_into(self, pool: dict, idx: Any, stage: Any, k_out: Any, v_out: Any,
                    batch: int, nbps: int, heads: Heads) -> None:
        """k_out/v_out [batch, kv, nbps*bs, head] <- the blocks idx of the pool.

        index_select (a row copy per block) into the staging buffer, then one transposing
        copy: the paged layouts keep head_size/x before block_size (K) and head_size
        before block_size (V), so no view of the gathered blocks is [ctx, head]."""
        torch = self.torch
        kc, vc = pool["k"], pool["v"]
        bs, kv, hs = self.args.block_size, heads.kv, heads.size
        # fp8 pools: the staged bytes are read as the fp8 dtype (the copies convert them)
        # and scaled after.
        fp8 = None if pool["kv"] == "auto" else self.ops.fp8_cache_dtype(pool["kv"])

        def values(st):
            return st if fp8 is None else st.view(fp8)

        if kc.dim() == 4:  # the flash layout: [block, token, kv head, dim], K and V alike
            for cache, out in ((kc, k_out), (vc, v_out)):
                st = stage.view(-1)[: idx.numel() * cache[0].numel()].view(
                    (idx.numel(),) + tuple(cache.shape[1:]))
                torch.index_select(cache, 0, idx, out=st)
                out.view(batch, kv, nbps, bs, hs).copy_(
                    values(st).view(batch, nbps, bs, kv, hs).permute(0, 3, 1, 2, 4))
        else:
            x = kc.shape[-1]
            ks = stage.view(-1)[: idx.numel() * kc[0].numel()].view(
                (idx.numel(),) + tuple(kc.shape[1:]))
            torch.index_select(kc, 0, idx, out=ks)
            k_out.view(batch, kv, nbps, bs, hs // x, x).copy_(
                values(ks).view(batch, nbps, kv, hs // x, bs, x).permute(0, 2, 1, 4, 3, 5))
            vs = stage.view(-1)[: idx.numel() * vc[0].numel()].view(
                (idx.numel(),) + tuple(vc.shape[1:]))
            torch.index_select(vc, 0, idx, out=vs)
            v_out.view(batch, kv, nbps, bs, hs).copy_(
                values(vs).view(batch, nbps, kv, hs, bs).permute(0, 2, 1, 4, 3))
        if fp8 is not None:
            k_out.mul_(FP8_SCALES[0])
            v_out.mul_(FP8_SCALES[1])

    # ---- one shape -------------------------------------------------------------------

    def run_shape(self, s: Shape, pool: dict) -> dict[str, Any]:
        torch, ops, a = self.torch, self.ops, self.args
        tdt = getattr(torch, s.dtype)
        h, bs = s.heads, a.block_size
        dev = self.dev
        kv_bytes = s.kv_bytes(self.cache_elem(s.dtype, s.kv))  # what v1 / v2 read
        peer_kv_bytes = s.kv_bytes(self.elem(s.dtype))  # the peers: the query dtype
        nbps = math.ceil(s.ctx / bs)
        scale = 1.0 / math.sqrt(h.size)
        fp8_kw: dict[str, Any] = {} if s.kv == "auto" else {
            "kv_cache_dtype": s.kv, "k_scale": FP8_SCALES[0], "v_scale": FP8_SCALES[1]}
        row: dict[str, Any] = {
            "dtype": SHORT_DTYPE[s.dtype], "kv_cache_dtype": s.kv, "heads": h.name,
            "num_heads": h.q,
            "num_kv_heads": h.kv, "head_size": h.size, "batch": s.batch, "ctx": s.ctx,
            "block_size": bs, "layout": a.kv_cache_layout, "kv_bytes": kv_bytes, "pool_GiB": round(pool["info"]["GiB"], 2),
            "auto": "v2" if ops.use_v2(s.ctx, s.batch, h.q) else "v1", "kernels": {},
        }
        t_setup = time.perf_counter()

        # Block tables: a random permutation of the pool, so logical neighbours are far apart.
        perm = torch.randperm(pool["num_blocks"], generator=self.gen)[: s.batch * nbps]
        block_tables = perm.view(s.batch, nbps).to(torch.int32).to(dev)
        idx = perm.to(dev)
        seq_lens = torch.full((s.batch,), s.ctx, dtype=torch.int32, device=dev)
        # Queries scaled by 2: logits of std ~2 give a peaked softmax, so the outputs are
        # not averages near zero and the correctness check has something to bite on.
        query = (torch.randn(s.batch, h.q, h.size, generator=self.gen) * 2).to(tdt).to(dev)

        # Contiguous cache with the same values, built once outside timing.
        stage = torch.empty(s.batch * nbps * h.kv * h.size * bs, dtype=pool["k"].dtype,
                            device=dev)
        k_cont = torch.empty(s.batch, h.kv, nbps * bs, h.size, dtype=tdt, device=dev)
        v_cont = torch.empty_like(k_cont)
        self.gather_into(pool, idx, stage, k_cont, v_cont, s.batch, nbps, h)
        k_sd, v_sd = k_cont[:, :, : s.ctx], v_cont[:, :, : s.ctx]
        gqa_kw: dict[str, Any] = {}
        if h.q != h.kv:
            if self.sdpa_gqa:
                gqa_kw = {"enable_gqa": True}
            else:
                k_sd = k_sd.repeat_interleave(h.q // h.kv, dim=1)
                v_sd = v_sd.repeat_interleave(h.q // h.kv, dim=1)
        q4 = query.unsqueeze(2)  # [batch, heads, 1, head]

        # Outputs and v2 scratch, preallocated.
        out_v1 = torch.empty_like(query)
        out_v2 = torch.empty_like(query)
        parts = max(1, math.ceil(s.ctx / ops.PARTITION_SIZE))
        exp_sums = torch.empty(s.batch, h.q, parts, dtype=torch.float32, device=dev)
        max_logits = torch.empty_like(exp_sums)
        tmp_out = torch.empty(s.batch, h.q, parts, h.size, dtype=tdt, device=dev)

        def run_v1():
            ops.paged_attention_v1(out_v1, query, pool["k"], pool["v"], h.kv, scale,
                                   block_tables, seq_lens, bs, s.ctx, **fp8_kw)
            return out_v1

        def run_v2():
            ops.paged_attention_v2(out_v2, exp_sums, max_logits, tmp_out, query, pool["k"],
                                   pool["v"], h.kv, scale, block_tables, seq_lens, bs, s.ctx,
                                   **fp8_kw)
            return out_v2

        sdpa_fn, sdpa_label = self.pick_sdpa(q4, k_sd, v_sd, scale, gqa_kw)
        row["sdpa_backend"] = sdpa_label

        def run_sdpa():
            return sdpa_fn(q4, k_sd, v_sd)

        def run_gather_sdpa():
            # Same destination as the contiguous cache: it is rewritten with the same values.
            self.gather_into(pool, idx, stage, k_cont, v_cont, s.batch, nbps, h)
            return sdpa_fn(q4, k_sd, v_sd)

        fns: dict[str, Callable[[], Any] | None] = {
            "v1": run_v1, "v2": run_v2, "sdpa": run_sdpa, "gather_sdpa": run_gather_sdpa,
            "flash_attn": None,
        }
        flash_pool = None
        if self.flash_attn is not None:
            try:
                fns["flash_attn"], flash_pool = self.make_flash(s, q4, k_cont, v_cont, scale)
            except Exception as e:  # report, keep going
                row["kernels"]["flash_attn"] = {"status": f"error: {type(e).__name__}: {e}"[:200]}
        if self.device == "cuda":
            torch.cuda.synchronize()
        row["setup_s"] = round(time.perf_counter() - t_setup, 3)

        # Correctness: every kernel against a float32 reference on the first and last sequence.
        check_seqs = sorted({0, s.batch - 1})
        ref = self.reference(query, k_cont[:, :, : s.ctx], v_cont[:, :, : s.ctx], scale,
                             check_seqs)
        ref_max = max(float(ref.abs().max()), 1e-6)
        tol = REL_TOL[s.dtype]
        for name, fn in fns.items():
            if fn is None:
                row["kernels"].setdefault("flash_attn", {"status": self.flash_note})
                continue
            entry: dict[str, Any] = {}
            try:
                out = fn()
                if self.device == "cuda":
                    torch.cuda.synchronize()
                out = out.reshape(s.batch, h.q, h.size)[check_seqs].float().cpu()
                err = float((out - ref).abs().max()) / ref_max
                entry["rel_err"] = err
                entry["status"] = "ok" if err <= tol and math.isfinite(err) else "WRONG"
            except Exception as e:
                entry["status"] = f"error: {type(e).__name__}: {e}"[:300]
                fns[name] = None
            row["kernels"][name] = entry
        # v1 and v2 against each other over the whole batch (the reference covers two rows).
        if row["kernels"]["v1"].get("status") == "ok" and row["kernels"]["v2"].get("status") == "ok":
            per_seq = (out_v1.float() - out_v2.float()).abs().flatten(1).amax(1).cpu()
            d = float(per_seq.max()) / ref_max
            row["v1_vs_v2_rel"] = d
            if d > tol:  # they disagree on a sequence not checked yet: check it too
                b = int(per_seq.argmax())
                ref_b = self.reference(query, k_cont[:, :, : s.ctx], v_cont[:, :, : s.ctx],
                                       scale, [b])[0]
                for name, out in (("v1", out_v1), ("v2", out_v2)):
                    err = float((out[b].float().cpu() - ref_b).abs().max()) / ref_max
                    if err > tol:
                        row["kernels"][name].update(
                            status="WRONG", rel_err=err, note=f"sequence {b} of {s.batch}")

        # Timing.
        flush = self.timer.flush_buf is not None and kv_bytes < 4 * self.llc
        row["cold_cache_flush"] = flush
        for name, fn in fns.items():
            entry = row["kernels"][name]
            if fn is None or entry.get("status") != "ok":
                continue
            try:
                t, n = self.timer.measure(fn, flush)
            except Exception as e:
                entry["status"] = f"error while timing: {type(e).__name__}: {e}"[:300]
                continue
            read = kv_bytes if name in ("v1", "v2") else peer_kv_bytes
            gbps = read / t / 1e9
            if self.timer.last_cpu_share is not None:
                entry["cpu_share"] = round(self.timer.last_cpu_share, 3)
            entry.update({"ms": t * 1e3, "ms_min": self.timer.last_min * 1e3, "iters": n,
                          "kv_bytes": read, "GBps": gbps,
                          "frac_copy_bw": gbps / self.copy_bw["copy_GBps"]})
        sd = row["kernels"]["sdpa"].get("ms")
        for name, entry in row["kernels"].items():
            if sd and entry.get("ms"):
                entry["vs_sdpa"] = entry["ms"] / sd
        return row

    def pick_sdpa(self, q, k, v, scale, gqa_kw) -> tuple[Callable, str]:
        """SDPA with the flash backend forced (CPU: its flash kernel; CUDA: FlashAttention),
        falling back to torch's own choice when flash refuses the shape or dtype."""
        F, torch = self.F, self.torch

        def plain(q_, k_, v_):
            return F.scaled_dot_product_attention(q_, k_, v_, scale=scale, **gqa_kw)

        if self.sdpa_kernel is not None:
            backend = self.SDPBackend.FLASH_ATTENTION

            def flash(q_, k_, v_):
                with self.sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q_, k_, v_, scale=scale, **gqa_kw)

            try:
                flash(q, k, v)
                if self.device == "cuda":
                    torch.cuda.synchronize()
                return flash, "flash" + ("+gqa" if gqa_kw else "")
            except RuntimeError as e:
                reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else "?"
                note = f"SDPA flash backend refused ({reason}); torch's default backend used"
                if note not in self.notes:
                    self.notes.append(note)
                log.debug("flash SDPA refused: %s", e)
        return plain, "default" + ("+gqa" if gqa_kw else "")

    def make_flash(self, s: Shape, q4, k_cont, v_cont, scale):
        """flash_attn_with_kvcache over its own paged pool (pages of 256 tokens,
        [num_pages, 256, kv_heads, head]) holding the same values, shuffled pages."""
        torch = self.torch
        h, page = s.heads, 256
        npages = math.ceil(s.ctx / page)
        tdt = k_cont.dtype
        page_bytes = 2 * page * h.kv * h.size * self.elem(s.dtype)
        total_pages = max(s.batch * npages, int(self.args.pool_gib * GIB) // page_bytes)
        fk = torch.empty(total_pages, page, h.kv, h.size, dtype=tdt, device=self.dev)
        fv = torch.empty_like(fk)
        perm = torch.randperm(total_pages, generator=self.gen)[: s.batch * npages].to(self.dev)
        tokens = npages * page
        for src, dst in ((k_cont, fk), (v_cont, fv)):
            padded = torch.zeros(s.batch, h.kv, tokens, h.size, dtype=tdt, device=self.dev)
            padded[:, :, : s.ctx] = src[:, :, : s.ctx]
            dst[perm] = padded.view(s.batch, h.kv, npages, page, h.size).permute(
                0, 2, 3, 1, 4).reshape(s.batch * npages, page, h.kv, h.size)
            del padded
        table = perm.view(s.batch, npages).to(torch.int32)
        seqlens = torch.full((s.batch,), s.ctx, dtype=torch.int32, device=self.dev)
        qf = q4.transpose(1, 2).contiguous()  # [batch, 1, heads, head]
        fa = self.flash_attn

        def run():
            return fa(qf, fk, fv, cache_seqlens=seqlens, block_table=table, softmax_scale=scale)

        return run, (fk, fv)

    def reference(self, query, k, v, scale, seqs) -> Any:
        """float32 attention of the given sequences, [len(seqs), heads, head] on the CPU."""
        torch = self.torch
        outs = []
        for b in seqs:
            kb = k[b].float()  # [kv, ctx, head]
            vb = v[b].float()
            kvh, hs = kb.shape[0], kb.shape[-1]
            qb = query[b].float().view(kvh, -1, hs)  # [kv, group, head]
            logits = torch.matmul(qb, kb.transpose(-1, -2)) * scale
            p = torch.softmax(logits, dim=-1)
            outs.append(torch.matmul(p, vb).reshape(-1, hs).cpu())
            del kb, vb
        return torch.stack(outs)

    # ---- driver ----------------------------------------------------------------------

    def run(self) -> None:
        torch, a = self.torch, self.args
        self.measure_bandwidth()
        groups = self.plan()
        for *_, skip in groups:
            for s, why in skip:
                self.rows.append(self.skipped_row(s, why))
        total = sum(len(g[4]) for g in groups)
        log.info("%d shapes to run, %d skipped for memory (budget %.1f GiB)", total,
                 len(self.rows), self.mem_budget / GIB)
        bar = _progress(total)
        deadline = a.deadline_min * 60 if a.deadline_min else None
        try:
            for dtype, kv_dtype, heads, pool_bytes, run, _ in groups:
                if not run:
                    continue
                if deadline and time.monotonic() - self.t_start > deadline:
                    for s in run:
                        self.rows.append(self.skipped_row(s, "not run: --deadline-min reached"))
                    continue
                pool = self.make_pool(dtype, kv_dtype, heads, pool_bytes)
                for i, s in enumerate(run):
                    if deadline and time.monotonic() - self.t_start > deadline:
                        for s2 in run[i:]:
                            self.rows.append(self.skipped_row(s2, "not run: --deadline-min reached"))
                        break
                    t0 = time.perf_counter()
                    try:
                        row = self.run_shape(s, pool)
                    except Exception as e:  # an OOM or a crash in one shape: record, go on
                        log.exception("shape %s failed", s.key)
                        row = self.skipped_row(s, f"error: {type(e).__name__}: {e}"[:300])
                    row["wall_s"] = round(time.perf_counter() - t0, 2)
                    self.rows.append(row)
                    log.info("%s %s b=%d ctx=%d: %s (%.1f s)", row["dtype"], row["heads"],
                             s.batch, s.ctx, _row_brief(row), row["wall_s"])
                    if bar is not None:
                        bar.update(1)
                del pool
                if self.device == "cuda":
                    torch.cuda.empty_cache()
                self.measure_bandwidth()  # again: the best sample is the machine's
        except KeyboardInterrupt:
            self.notes.append("interrupted: the table holds the shapes finished before")
            log.warning("interrupted; writing the partial results")
        finally:
            if bar is not None:
                bar.close()

    def measure_bandwidth(self) -> None:
        """Copy bandwidth, measured at the start and after each pool; the best sample is
        used for every row's fraction (a sample taken while other processes ran is low)."""
        sample = copy_bandwidth(self.torch, self.device, int(self.args.bandwidth_gib * GIB))
        self.bw_samples.append(round(sample["copy_GBps"], 2))
        if not getattr(self, "copy_bw", None) or sample["copy_GBps"] > self.copy_bw["copy_GBps"]:
            self.copy_bw = sample
        log.info("copy bandwidth %.1f GB/s (read+write), read %.1f GB/s; best so far %.1f GB/s",
                 sample["copy_GBps"], sample["read_GBps"], self.copy_bw["copy_GBps"])
        for r in self.rows:  # fractions always against the best sample
            for k in r.get("kernels", {}).values():
                if "GBps" in k:
                    k["frac_copy_bw"] = k["GBps"] / self.copy_bw["copy_GBps"]

    def skipped_row(self, s: Shape, why: str) -> dict[str, Any]:
        return {"dtype": SHORT_DTYPE[s.dtype], "kv_cache_dtype": s.kv, "heads": s.heads.name,
                "batch": s.batch, "ctx": s.ctx,
                "kv_bytes": s.kv_bytes(self.cache_elem(s.dtype, s.kv)), "skipped": why,
                "kernels": {}}

    # ---- reporting -------------------------------------------------------------------

    def meta(self) -> dict[str, Any]:
        torch, a = self.torch, self.args
        m: dict[str, Any] = {
            "device": self.device,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "copy_bandwidth": self.copy_bw,
            "copy_bandwidth_samples_GBps": self.bw_samples,
            "block_size": a.block_size,
            "pool_min_GiB": a.pool_gib,
            "pools": self.pools,
            "mem_budget_GiB": round(self.mem_budget / GIB, 1),
            "cold_cache": (f"a {self.timer.flush_bytes / MIB:.0f} MiB buffer "
                           f"{'zeroed' if self.device == 'cuda' else 'read'} before each timed call "
                           f"when the KV read is under 4x the {self.llc / MIB:.0f} MiB "
                           f"{'L2' if self.device == 'cuda' else 'last-level cache'}")
            if self.timer.flush_buf is not None else "no flush (--no-flush)",
            "timing": f"median of >= {a.min_iters} calls (<= {a.max_iters}, ~{a.target_s} s per "
                      f"kernel) after {a.warmup} warmup; "
                      + ("CUDA events" if self.device == "cuda" else "time.perf_counter"),
            "sdpa_gqa": "enable_gqa=True" if self.sdpa_gqa else "K/V expanded outside timing",
            "flash_attn": self.flash_note,
            "notes": self.notes,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                     if k != "head_cfgs"},
            "elapsed_s": round(time.monotonic() - self.t_start, 1),
            "loadavg_1min": {"start": self.load_start, "end": _loadavg()},
        }
        if self.device == "cuda":
            p = torch.cuda.get_device_properties(0)
            m["gpu"] = p.name
            m["capability"] = f"{p.major}.{p.minor}"
            m["cuda"] = torch.version.cuda
        else:
            m["cpu"] = cpu_model()
            m["cores"] = os.cpu_count()
            m["llc_MiB"] = self.llc // MIB
        isa = getattr(self.ops, "get_cpu_isa", None) or getattr(self.ops, "cpu_isa", None)
        if callable(isa):
            try:
                m["cpu_isa"] = isa()
            except Exception:
                pass
        return m

    def markdown(self, meta: dict[str, Any]) -> str:
        bw = meta["copy_bandwidth"]
        machine = meta.get("gpu") or f"{meta.get('cpu')} ({meta.get('cores')} cores, " \
                                     f"LLC {meta.get('llc_MiB')} MiB)"
        lines = [
            f"## vllm_lite decode attention, {self.device}",
            "",
            f"- machine: {machine}; torch {meta['torch']}"
            + (f", CUDA {meta.get('cuda')}, sm {meta.get('capability')}" if self.device == "cuda" else "")
            + f"; threads {meta['threads']}" + (f"; CPU ISA {meta['cpu_isa']}" if "cpu_isa" in meta else "")
            + f"; load average {meta['loadavg_1min']['start']} at start, "
              f"{meta['loadavg_1min']['end']} at end; run took {meta['elapsed_s']:.0f} s",
            f"- copy bandwidth {bw['copy_GBps']:.1f} GB/s (bytes read + written, "
            f"{bw['bytes'] / GIB:g} GiB copies; best of {len(meta['copy_bandwidth_samples_GBps'])} samples taken at the "
            f"start and after each pool: {', '.join(f'{x:.1f}' for x in meta['copy_bandwidth_samples_GBps'])}); "
            f"read bandwidth {bw['read_GBps']:.1f} GB/s",
            f"- KV pools (shuffled block tables, block size {meta['block_size']}): "
            + ", ".join(f"{p['dtype']}{'' if p['kv_cache_dtype'] == 'auto' else ' ' + p['kv_cache_dtype']} "
                        f"{p['heads']} {p['GiB']:.1f} GiB" for p in meta["pools"]),
            "- cells: median time, achieved KV bandwidth (KV bytes read / time) and its "
            "fraction of the copy bandwidth; ratio columns: time / SDPA contiguous time; "
            "fp8 speedup: the 16-bit-cache row's time / the fp8 row's (auto kernel); the "
            "peers of an fp8 row read the dequantized values in the query dtype"
            + (f" (fp8 scales k {FP8_SCALES[0]}, v {FP8_SCALES[1]})"
               if any(k != "auto" for k in self.args.kv_cache_dtypes) else ""),
            f"- {meta['timing']}; cold cache: {meta['cold_cache']}",
            f"- SDPA: {meta['sdpa_gqa']} for GQA, backend per row; flash_attn: {meta['flash_attn']}",
            f"- check: each kernel vs a float32 reference on the first and last sequence "
            f"(max |err| / max |ref| <= {', '.join(f'{SHORT_DTYPE[k]} {v:g}' for k, v in REL_TOL.items())})",
        ]
        if self.device == "cpu":
            lines.append("- CPU share: CPU time of the benchmark's threads / (wall time x "
                         "threads) over the timed calls, lowest kernel of the row; ⚠ under 0.8: "
                         "other processes took cores during the timing, distrust that row")
        for n in meta["notes"]:
            lines.append(f"- note: {n}")
        lines += ["", "| dtype | KV cache | heads | batch | ctx | KV MiB | " + " | ".join(
            KERNEL_TITLES[k] for k in KERNELS) + " | v1/SDPA | v2/SDPA | auto | fp8 speedup "
            "| SDPA backend | check |" + (" CPU share |" if self.device == "cpu" else ""),
            "|" + "---|" * (6 + len(KERNELS) + 6 + (self.device == "cpu"))]
        speedups = self.fp8_speedups()
        for i, r in enumerate(self.rows):
            head = f"| {r['dtype']} | {r.get('kv_cache_dtype', 'auto')} | {r['heads']} | " \
                   f"{r['batch']} | {r['ctx']} | {r['kv_bytes'] / MIB:.4g} |"
            if "skipped" in r:
                lines.append(head + f" {r['skipped']} |"
                             + " |" * (len(KERNELS) + 5 + (self.device == "cpu")))
                continue
            cells = [_cell(r["kernels"].get(k, {})) for k in KERNELS]
            ratios = [_ratio(r["kernels"].get(k, {})) for k in ("v1", "v2")]
            bad = [k for k in KERNELS if r["kernels"].get(k, {}).get("status") not in
                   (None, "ok") and not str(r["kernels"][k].get("status", "")).startswith("n/a")]
            check = "ok" if not bad else "**" + ", ".join(
                f"{k} {r['kernels'][k]['status'].split(':')[0]}" for k in bad) + "**"
            extra = []
            if self.device == "cpu":
                shares = [k["cpu_share"] for k in r["kernels"].values() if "cpu_share" in k]
                extra = [f"{min(shares):.2f}" + (" ⚠" if min(shares) < 0.8 else "")
                         if shares else ""]
            sp = f"{speedups[i]:.2f}x" if i in speedups else ""
            lines.append(head + " " + " | ".join(cells + ratios + [r["auto"], sp,
                                                                    r["sdpa_backend"], check]
                                                   + extra) + " |")
        goals = self.goals()
        if goals:
            lines += ["", "### Goals (reported, not asserted)", ""] + goals
        return "\n".join(lines) + "\n"

    def fp8_speedups(self) -> dict[int, float]:
        """Row index of each timed fp8-cache row -> time of the same shape's 16-bit-cache
        row / its time (the kernel `paged_attention` picks in both)."""
        def key(r):
            return (r["dtype"], r["heads"], r["batch"], r["ctx"], r.get("layout"))

        def ms(r):
            return r.get("kernels", {}).get(r.get("auto"), {}).get("ms")

        base = {key(r): ms(r) for r in self.rows
                if r.get("kv_cache_dtype", "auto") == "auto" and ms(r)}
        return {i: base[key(r)] / ms(r) for i, r in enumerate(self.rows)
                if r.get("kv_cache_dtype", "auto") != "auto" and ms(r) and key(r) in base}

    def goals(self) -> list[str]:
        """--goal-copy-bw / --goal-vs-sdpa: whether each timed row's paged kernel (the one
        `paged_attention` picks) reaches that fraction of copy bandwidth and stays within
        that multiple of SDPA's time on the contiguous cache."""
        bw, vs, f8 = self.args.goal_copy_bw, self.args.goal_vs_sdpa, self.args.goal_fp8_speedup
        if bw is None and vs is None and f8 is None:
            return []
        if bw is None and vs is None:
            return self.fp8_goal(f8)
        wanted = [f">= {bw:.0%} of copy bandwidth" if bw is not None else "",
                  f"<= {vs}x SDPA time" if vs is not None else ""]
        out = ["paged kernel (the one `paged_attention` picks): "
               + " and ".join(w for w in wanted if w) + ":"]
        rows = [r for r in self.rows if "skipped" not in r]
        if not rows:
            return out + ["- no timed rows"]
        fails, timed = [], 0
        for r in rows:
            k = r["kernels"].get(r["auto"], {})
            if "ms" not in k:
                fails.append(f"{_rowname(r)}: {r['auto']} not timed ({k.get('status')})")
                continue
            timed += 1
            why = []
            if vs is not None and k.get("vs_sdpa", math.inf) > vs:
                why.append(f"{k.get('vs_sdpa', math.nan):.2f}x SDPA time")
            if bw is not None and k["frac_copy_bw"] < bw:
                why.append(f"{k['frac_copy_bw']:.0%} of copy bandwidth")
            if why:
                fails.append(f"{_rowname(r)}: " + ", ".join(why))
        out.append(f"- {timed - sum(1 for f in fails if 'not timed' not in f)} of {len(rows)} "
                   f"rows met")
        noisy = sum(1 for r in rows if any(k.get("cpu_share", 1) < 0.8
                                           for k in r["kernels"].values()))
        if noisy:
            out.append(f"- caution: {noisy} of these rows were timed while other processes "
                       f"held cores (CPU share < 0.8)")
        return out + [f"- missed: {f}" for f in fails] + (self.fp8_goal(f8) if f8 else [])

    def fp8_goal(self, ratio: float) -> list[str]:
        """--goal-fp8-speedup: each fp8 row with a 16-bit-cache row of the same shape."""
        sp = self.fp8_speedups()
        out = [f"fp8 cache >= {ratio}x faster than the 16-bit cache (same shape, paged kernel "
               f"`paged_attention` picks):",
               f"- {sum(v >= ratio for v in sp.values())} of {len(sp)} fp8 rows met"]
        return out + [f"- missed: {_rowname(self.rows[i])}: {v:.2f}x" for i, v in sp.items()
                      if v < ratio]

    def write(self) -> tuple[Path, Path, str]:
        meta = self.meta()
        md = self.markdown(meta)
        self.args.out.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        base = self.args.out / f"kernels_{self.device}_{stamp}"
        base.with_suffix(".md").write_text(md)
        base.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": self.rows},
                                                        indent=1, default=str) + "\n")
        return base.with_suffix(".md"), base.with_suffix(".json"), md


def _loadavg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def _sdpa_has_enable_gqa(torch: Any) -> bool:
    q = torch.zeros(1, 2, 1, 8)
    k = torch.zeros(1, 1, 4, 8)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return True
    except TypeError:
        return False


def _cell(k: dict[str, Any]) -> str:
    if "ms" in k:
        return f"{k['ms']:.3g} ms · {k['GBps']:.1f} GB/s · {k['frac_copy_bw']:.0%}"
    st = k.get("status", "")
    if st.startswith("n/a"):
        return "n/a"
    if st == "WRONG":
        return f"WRONG (err {k.get('rel_err', float('nan')):.1e})"
    return st.split(":")[0] if st else ""


def _ratio(k: dict[str, Any]) -> str:
    return f"{k['vs_sdpa']:.2f}" if "vs_sdpa" in k else ""


def _rowname(r: dict[str, Any]) -> str:
    kv = r.get("kv_cache_dtype", "auto")
    return (f"{r['dtype']}{'' if kv == 'auto' else ' ' + kv + ' cache'} {r['heads']} "
            f"b={r['batch']} ctx={r['ctx']}")


def _row_brief(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return r["skipped"]
    parts = []
    for k in KERNELS:
        e = r["kernels"].get(k, {})
        if "ms" in e:
            parts.append(f"{k} {e['ms']:.3g} ms ({e['frac_copy_bw']:.0%})")
        elif e.get("status") and not e["status"].startswith("n/a"):
            parts.append(f"{k} {e['status'][:60]}")
    return ", ".join(parts)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    if not sys.stderr.isatty():
        return None  # logs carry the progress; no bar in files
    return tqdm(total=total, unit="shape", leave=False)


def main(argv: list[str] | None = None) -> int:
    return run_args(parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """Runs the benchmark from parsed, finished arguments; the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    if args.verbose:
        log.setLevel(logging.DEBUG)
    threads = args.threads or os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` -> partial tables

    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    if args.device == "cuda" and not torch.cuda.is_available():
        log.error("--device cuda: torch %s (CUDA build: %s) sees no GPU "
                  "(torch.cuda.is_available() is False); nothing to benchmark",
                  torch.__version__, torch.version.cuda or "no")
        return 2
    try:
        import vllm_lite.ops
    except ImportError as e:
        log.error("cannot import vllm_lite.ops: %s\nBuild the extension first, e.g. "
                  "`VLLM_LITE_TARGET=%s python setup.py build_ext --inplace`", e, args.device)
        return 2
    if args.device == "cuda":
        try:
            has = torch._C._dispatch_has_kernel_for_dispatch_key(
                "vllm_lite::paged_attention_v1", "CUDA")
        except RuntimeError:
            has = False
        if not has:
            log.error("vllm_lite was built without CUDA kernels (no CUDA implementation of "
                      "paged_attention_v1); rebuild with VLLM_LITE_TARGET=cuda")
            return 2
    if args.prefill:
        if args.cpu_isa:
            vllm_lite.ops.set_cpu_isa(args.cpu_isa)
        md = prefill_kernels.run(args, Timer)
        print(md)
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = args.out / f"prefill_kernels_{args.device}_{stamp}.md"
        path.write_text(md + "\n")
        log.info("wrote %s", path)
        return 0 if "WRONG" not in md and "error" not in md else 1
    try:
        bench = Bench(args)
    except ValueError as e:  # --cpu-isa this CPU cannot run
        log.error("%s", e)
        return 2
    if args.dry_run:
        for dtype, heads, pool_bytes, run, skip in bench.plan():
            kv = sum(s.kv_bytes(bench.elem(dtype)) for s in run)
            print(f"{SHORT_DTYPE[dtype]} {heads.name}: pool {pool_bytes / GIB:.1f} GiB, "
                  f"{len(run)} shapes ({kv / GIB:.1f} GiB of KV in all), {len(skip)} skipped")
            for s, why in skip:
                print(f"  b={s.batch} ctx={s.ctx}: {why}")
        print(f"memory budget {bench.mem_budget / GIB:.1f} GiB")
        return 0
    bench.run()
    md_path, json_path, md = bench.write()
    print(md)
    log.info("wrote %s and %s (%.0f s)", md_path, json_path, time.monotonic() - bench.t_start)
    bad = [r for r in bench.rows if any(str(k.get("status", "")).startswith(("WRONG", "error"))
                                        for k in r.get("kernels", {}).values())]
    if bad:
        log.warning("%d shapes with wrong or failing kernels: %s", len(bad),
                    "; ".join(_rowname(r) for r in bad[:10]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
