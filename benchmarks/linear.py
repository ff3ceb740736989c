"""Linear-layer benchmark: the engine's CPU GEMM (vllm_lite's packed_linear where the CPU has its kernel) against oneDNN's, torch's own, and the int8 weight-only GEMMs.

For each projection shape (K x N; default: the default model's qkv, o, gate_up and down)
and each row count (tokens in the step), one run times, on the CPU:

- the engine's projection (``Linear`` after ``prepare_for_cpu``: ``ops.packed_linear``
  where the selected CPU build has a kernel for the dtype, float32 on AVX-512 and
  bfloat16 on AVX512_BF16, else oneDNN on its prepacked weight): the reference of the
  ratios;
- ``oneDNN``: ``mkldnn._linear_pointwise`` on a weight prepacked by
  ``mkldnn._reorder_linear_weight`` (what the engine used before packed_linear; the peer).
  torch's bf16 prepacking needs AVX512BW/VL/DQ or AVX-NE-CONVERT: on other CPUs (AVX2-only
  x86, aarch64) the column is n/a and the report says why;
- ``torch``: ``F.linear`` on the plain weight (MKL's sgemm for float32 in the official
  builds, oneDNN unpacked for bf16);
- ``vllm_lite int8``: ``torch.ops.vllm_lite.int8_linear`` (quantization="int8") on the
  weight in the form ``Int8Linear`` keeps (packed in panels on AVX-512 builds);
- ``torch int8``: ``aten._weight_int8pack_mm`` on the same int8 weight.

Each cell is the median of timed calls after a warm-up. By default the weights stay in the
caches; ``--cold`` cycles every call through enough copies of each weight form (4x the
last-level cache) that each call streams its weight from memory, as the projections of a
decode step do (the model's weights are far larger than the cache). The error columns
check the engine's GEMM and the int8 kernel against a float64 matmul (relative to the
largest output). Writes ``linear.md`` to --out and prints it.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/linear.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import itertools
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import RESULTS_DIR
from .common import time_us
from vllm_lite.config import THREADS_HELP, set_threads

log = logging.getLogger(__name__)

# The default model's (SmolLM2-135M) projections: qkv, o, gate_up, down.
DEFAULT_SHAPES = ("576x960", "576x576", "576x3072", "1536x576")
DEFAULT_ROWS = (1, 4, 8, 16, 32, 64, 256)
QUICK_ROWS = (1, 8, 32)
# --cold's copies of one weight at most: each copy is a Linear and three more tensors, so on
# a 480 MiB last-level cache a 64x32 weight would need 250,000 of them (tens of GB of
# Python objects); weights under 4x the cache / this many bytes stay partly cached.
MAX_COLD_COPIES = 1024


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
                   help="activations and weights of every column (the int8 columns: "
                   "activations); bfloat16 runs int8_linear's bf16 kernel (vdpbf16ps where "
                   "the CPU has AVX512-BF16) (default: %(default)s)")
    p.add_argument("--cold", action="store_true",
                   help="each call reads its weight from memory (copies cycled, 4x the "
                   "last-level cache), as in a decode step")
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


def _onednn_pack(w: Any) -> Any:
    """oneDNN's prepacked form of weight ``w`` (what the oneDNN column multiplies)."""
    import torch

    from vllm_lite.models.llama import Linear

    return torch.ops.mkldnn._reorder_linear_weight(w, Linear.PACK_ROWS_HINT)


def onednn_unavailable(dtype: Any) -> str | None:
    """Why torch's oneDNN prepacked GEMM cannot run ``dtype`` on this CPU (its error), or
    None where it runs. The bf16 path depends on the CPU's ISA extensions."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    try:
        _onednn_pack(torch.zeros(4, 8, dtype=dtype))
    except (RuntimeError, AttributeError) as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def _cycle(items: list[Any]) -> Callable[[], Any]:
    """A function returning the items in turn (one copy of a weight per call)."""
    it = itertools.cycle(items)
    return lambda: next(it)


def run(args: argparse.Namespace) -> str:
    """The report (markdown) of one run."""
    import torch
    import torch.nn.functional as F

    from vllm_lite import ops
    from .kernels import llc_bytes_cpu
    from vllm_lite.layers.quantization import cpu_qweight, quantize_int8
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
    llc = llc_bytes_cpu()
    no_onednn = onednn_unavailable(dtype)
    # Linear.prepare_for_cpu's choice: its own kernel, else oneDNN prepacked where torch
    # can prepack this dtype here, else F.linear.
    engine = ("packed_linear" if ops.packed_linear_kernel_selected(dtype) else
              "oneDNN" if no_onednn is None else "F.linear (oneDNN cannot prepack it here)")
    if no_onednn:
        log.warning("oneDNN %s column n/a: %s", args.dtype, no_onednn)
    lines = [
        f"# Linear layers on the CPU ({torch.get_num_threads()} threads, CPU ISA "
        f"{ops.cpu_isa()}, torch {torch.__version__}, {args.dtype}, weights "
        f"{'from memory (--cold)' if args.cold else 'in cache'})",
        "",
        f"The engine's {d} GEMM here: {engine}.",
        "",
        f"| K x N | rows | engine {d} (us) | oneDNN {d} (us) | torch {d} (us) | "
        f"vllm_lite int8 (us) | torch int8 (us) | oneDNN speedup | torch speedup | "
        f"vllm_lite int8 speedup | torch int8 speedup | engine max rel err | "
        f"int8 max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    with torch.inference_mode():
        for k, n in shapes:
            elem = torch.empty((), dtype=dtype).element_size()
            copies = min(math.ceil(4 * llc / (n * k * elem)), MAX_COLD_COPIES) if args.cold else 1
            if copies * n * k * elem < 4 * llc:
                log.warning("%dx%d: %d copies of the weight (%.0f MiB) do not reach 4x the "
                            "last-level cache (%.0f MiB): its --cold cells are partly cached",
                            k, n, copies, copies * n * k * elem / 2**20, llc / 2**20)
            w = torch.randn(n, k, generator=gen) * 0.05
            lins, dnn, plain, q8 = [], [], [], []
            for _ in range(copies):
                lin = Linear(k, n, bias=False, dtype=dtype)
                lin.weight.copy_(w)
                lin.prepare_for_cpu()
                lins.append(lin)
                plain.append(lin.weight.detach().clone())
                if not no_onednn:
                    dnn.append(_onednn_pack(plain[-1]))
                q, scale = quantize_int8(lin.weight)
                q8.append((cpu_qweight(q), scale, q))  # the engine's form, and torch's
            scale_t = q8[0][1].to(dtype)  # torch's op wants the scales in x's dtype
            deq = q8[0][2].double() * q8[0][1].double()[:, None]
            w64 = lins[0].weight.double()
            nxt = {name: _cycle(items) for name, items in
                   (("lin", lins), ("dnn", dnn), ("plain", plain), ("q8", q8))}
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(dtype)
                ours = time_us(lambda: nxt["lin"]()(x), target)
                onednn = None if no_onednn else time_us(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, nxt["dnn"](), None, "none",
                                                               [], ""), target)
                torch_mm = time_us(lambda: F.linear(x, nxt["plain"]()), target)
                int8 = time_us(lambda: ops.int8_linear(x, *nxt["q8"]()[:2]), target)
                # torch's bf16 int8 op crashes (SIGSEGV, torch 2.14) for K not a multiple
                # of 16: that column is n/a there.
                theirs = (None if dtype == torch.bfloat16 and k % 16 else
                          time_us(lambda: torch.ops.aten._weight_int8pack_mm(
                              x, nxt["q8"]()[2], scale_t), target))
                ref = x.double() @ w64.t()
                err = float((lins[0](x).double() - ref).abs().max()
                            / ref.abs().max().clamp_min(1e-30))
                ref8 = x.double() @ deq.t()
                err8 = float((ops.int8_linear(x, *q8[0][:2]).double() - ref8).abs().max()
                             / ref8.abs().max().clamp_min(1e-30))
                theirs_cells = ("n/a", "n/a") if theirs is None else (f"{theirs:.1f}",
                                                                      f"{ours / theirs:.2f}")
                dnn_cells = ("n/a", "n/a") if onednn is None else (f"{onednn:.1f}",
                                                                   f"{ours / onednn:.2f}")
                lines.append(f"| {k} x {n} | {m} | {ours:.1f} | {dnn_cells[0]} | {torch_mm:.1f} | "
                             f"{int8:.1f} | {theirs_cells[0]} | {dnn_cells[1]} | "
                             f"{ours / torch_mm:.2f} | {ours / int8:.2f} | {theirs_cells[1]} | "
                             f"{err:.1e} | {err8:.1e} |")
                log.info("%dx%d rows %d: engine %.1f us, oneDNN %s us, int8 %.1f us", k, n, m,
                         ours, dnn_cells[0], int8)
    lines += ["", f"Speedup: the engine's {d} time / that column's time (below 1: that "
              f"column is slower than the engine's {args.dtype} GEMM). Errors: relative to "
              "the largest output, against float64 on the same (rounded) x and weight; bf16 "
              "outputs carry their own rounding (2^-9)."]
    if no_onednn:
        lines += ["", f"oneDNN {d}: n/a on this CPU (torch: {no_onednn})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-lite bench linear",
                                description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    from .common import run_markdown_report

    return run_markdown_report("vllm-lite bench linear", run, args, "linear.md")


if __name__ == "__main__":
    sys.exit(main())
