"""Linear-layer benchmark: vllm_lite's int8 weight-only GEMM against the float32 (or bf16) GEMM and torch's int8 weight-only op.

For each projection shape (K x N; default: the default model's qkv, o, gate_up and down)
and each row count (tokens in the step), one run times, on the CPU:

- ``fp32``: the engine's float32 projection (oneDNN on the weight that
  ``Linear.prepare_for_cpu`` prepacks), the reference of the ratios (``--dtype bfloat16``:
  every column's activations are bf16, and this is the engine's bf16 projection);
- ``torch fp32``: ``F.linear`` on the plain weight (torch's own CPU path, MKL's sgemm in
  the official builds): what the engine's float32 projection replaced;
- ``vllm_lite int8``: ``torch.ops.vllm_lite.int8_linear`` (quantization="int8");
- ``torch int8``: ``aten._weight_int8pack_mm`` on the same int8 weight (what the layer
  would use without vllm_lite's kernel).

Each cell is the median of timed calls after a warm-up; the weights are small enough to
stay in the caches, as in a decode step of a small model. The error column checks the int8
kernel against a float64 matmul on the dequantized weight (relative to the largest output).
Writes ``linear.md`` to --out and prints it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from vllm_lite.benchmarks import RESULTS_DIR
from vllm_lite.benchmarks.common import time_us
from vllm_lite.config import THREADS_HELP, set_threads

log = logging.getLogger(__name__)

# The default model's (SmolLM2-135M) projections: qkv, o, gate_up, down.
DEFAULT_SHAPES = ("576x960", "576x576", "576x3072", "1536x576")
DEFAULT_ROWS = (1, 4, 8, 16, 32, 64, 256)
QUICK_ROWS = (1, 8, 32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help=f"rows {' '.join(map(str, QUICK_ROWS))} "
                   "and a shorter time per cell (well under a minute on 2 cores)")
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), metavar="KxN",
                   help="input x output features (default: %(default)s)")
    p.add_argument("--rows", nargs="+", type=int, default=None,
                   help=f"rows per call (default: {' '.join(map(str, DEFAULT_ROWS))})")
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds of timed calls per cell (default 0.3; --quick 0.1)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="activations (and the reference GEMM's weight) of every column: "
                   "bfloat16 runs int8_linear's bf16 kernel (vdpbf16ps where the CPU has "
                   "AVX512-BF16) against oneDNN's bf16 GEMM (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder "
                   "(default: %(default)s)")


def _parse_shape(s: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise ValueError(f"--shapes: {s!r} is not KxN (e.g. 576x960)") from None
    if k < 1 or n < 1:
        raise ValueError(f"--shapes: {s!r} needs K, N >= 1")
    return k, n


def run(args: argparse.Namespace) -> str:
    """The report (markdown) of one run."""
    import torch
    import torch.nn.functional as F

    from vllm_lite import ops
    from vllm_lite.layers.quantization import quantize_int8
    from vllm_lite.models.llama import Linear

    set_threads(args.threads)
    shapes = [_parse_shape(s) for s in args.shapes]
    rows = args.rows or list(QUICK_ROWS if args.quick else DEFAULT_ROWS)
    if any(r < 1 for r in rows):
        raise ValueError("--rows must be >= 1")
    target = args.target_s if args.target_s is not None else (0.1 if args.quick else 0.3)
    gen = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    d = "fp32" if dtype == torch.float32 else "bf16"
    lines = [
        f"# Linear layers on the CPU ({torch.get_num_threads()} threads, CPU ISA "
        f"{ops.cpu_isa()}, torch {torch.__version__}, {args.dtype} activations)",
        "",
        f"| K x N | rows | {d} (us) | torch {d} (us) | vllm_lite int8 (us) | torch int8 (us) | "
        f"torch {d} speedup | vllm_lite int8 speedup | torch int8 speedup | int8 max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    with torch.inference_mode():
        for k, n in shapes:
            lin = Linear(k, n, bias=False, dtype=dtype)
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
            lin.prepare_for_cpu()
            plain = lin.weight.detach().clone()
            q, scale = quantize_int8(lin.weight)
            deq = q.double() * scale.double()[:, None]
            scale_t = scale.to(dtype)  # torch's op wants the scales in x's dtype
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(dtype)
                fp32 = time_us(lambda: lin(x), target)
                torch_fp32 = time_us(lambda: F.linear(x, plain), target)
                ours = time_us(lambda: ops.int8_linear(x, q, scale), target)
                theirs = time_us(lambda: torch.ops.aten._weight_int8pack_mm(x, q, scale_t),
                                  target)
                ref = x.double() @ deq.t()
                err = float((ops.int8_linear(x, q, scale).double() - ref).abs().max()
                            / ref.abs().max().clamp_min(1e-30))
                lines.append(f"| {k} x {n} | {m} | {fp32:.1f} | {torch_fp32:.1f} | {ours:.1f} | "
                             f"{theirs:.1f} | {fp32 / torch_fp32:.2f} | {fp32 / ours:.2f} | "
                             f"{fp32 / theirs:.2f} | {err:.1e} |")
                log.info("%dx%d rows %d: fp32 %.1f us, int8 %.1f us", k, n, m, fp32, ours)
    lines += ["", f"Speedup: {d} time / that column's time (above 1: faster than the engine's "
              f"{args.dtype} GEMM). Error: relative to the largest output, against float64 "
              "on the same (rounded) x; bf16 outputs carry their own rounding (2^-9)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-lite bench linear",
                                description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    from vllm_lite.benchmarks.common import run_markdown_report

    return run_markdown_report("vllm-lite bench linear", run, args, "linear.md")
