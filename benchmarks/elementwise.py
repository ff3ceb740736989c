"""Element-wise op benchmark: vllm_lite's native rms_norm / fused_add_rms_norm / silu_and_mul / rotary_embedding against the torch code they replaced.

For each row count (tokens in a step) one run times, on the CPU, each native op and its
peer, the eager torch expression with the same rounding (the model's code before the
native ops: HF Llama's RMSNorm, ``hidden + out`` then RMSNorm, ``F.silu(gate) * up``,
rotate_half with the cos / sin gathered and cast per call), on the default model's sizes
(hidden 576, intermediate 1536, 9 / 3 heads of 64; ``--hidden`` etc. to change), and
checks that both give the same values (max difference in the last column, relative to
the largest output). Each cell is the median of timed calls after a warm-up.
Writes ``elementwise.md`` to --out and prints it.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/elementwise.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from . import RESULTS_DIR
from .common import time_us
from vllm_lite.config import THREADS_HELP, set_threads

log = logging.getLogger(__name__)

DEFAULT_ROWS = (1, 8, 32, 128, 512)
QUICK_ROWS = (1, 32, 256)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help=f"rows {' '.join(map(str, QUICK_ROWS))} "
                   "and a shorter time per cell (seconds on 2 cores)")
    p.add_argument("--rows", nargs="+", type=int, default=None,
                   help=f"tokens per call (default: {' '.join(map(str, DEFAULT_ROWS))})")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES),
                   help="(default: %(default)s)")
    p.add_argument("--hidden", type=int, default=576, help="(default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=1536, help="(default: %(default)s)")
    p.add_argument("--heads", default="9/3x64", metavar="Q/KVxD",
                   help="query heads / kv heads x head size (default: %(default)s)")
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds of timed calls per cell (default 0.3; --quick 0.05)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder "
                   "(default: %(default)s)")


def _parse_heads(s: str) -> tuple[int, int, int]:
    try:
        qkv, d = s.lower().split("x")
        q, kv = qkv.split("/")
        out = int(q), int(kv), int(d)
    except ValueError:
        raise ValueError(f"--heads: {s!r} is not Q/KVxD (e.g. 9/3x64)") from None
    if min(out) < 1 or out[2] % 2 or out[0] % out[1]:
        raise ValueError(f"--heads: {s!r} needs positive sizes, an even head size and "
                         "query heads a multiple of kv heads")
    return out


def run(args: argparse.Namespace) -> str:
    """The report (markdown) of one run."""
    import torch
    import torch.nn.functional as F

    from vllm_lite import ops
    from vllm_lite.layers.rotary import RotaryEmbedding

    set_threads(args.threads)
    rows = args.rows or list(QUICK_ROWS if args.quick else DEFAULT_ROWS)
    if any(r < 1 for r in rows):
        raise ValueError("--rows must be >= 1")
    for name in ("hidden", "intermediate"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    nq, nkv, d = _parse_heads(args.heads)
    target = args.target_s if args.target_s is not None else (0.05 if args.quick else 0.3)
    h, inter = args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(args.seed)
    rope = RotaryEmbedding(d, 8192, {"rope_type": "default", "rope_theta": 100000.0})
    table = rope.cos_sin_cache
    eps = 1e-5

    def torch_norm(x, w):
        hf = x.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        return w * hf.to(x.dtype)

    def torch_rotate(pos, qk, dtype):
        cos, sin = table.index_select(0, pos).chunk(2, dim=-1)
        cos, sin = cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
        x1, x2 = qk.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    lines = [
        f"# Element-wise ops on the CPU ({torch.get_num_threads()} threads, CPU ISA "
        f"{ops.cpu_isa()}, torch {torch.__version__}; hidden {h}, intermediate {inter}, "
        f"heads {nq}/{nkv}x{d})",
        "",
        "| dtype | op | rows | vllm_lite (us) | torch eager (us) | speedup | max rel diff |",
        "|---|---|---|---|---|---|---|",
    ]
    with torch.inference_mode():
        for dname in args.dtypes:
            dtype = getattr(torch, DTYPES[dname])
            w = torch.randn(h, generator=gen).to(dtype)
            for m in rows:
                x = torch.randn(m, h, generator=gen).to(dtype)
                res = torch.randn(m, h, generator=gen).to(dtype)
                gu = torch.randn(m, 2 * inter, generator=gen).to(dtype)
                pos = torch.randint(0, 8192, (m,), generator=gen)
                qkv = torch.randn(m, (nq + 2 * nkv) * d, generator=gen).to(dtype)
                out = torch.empty_like(x)
                act = torch.empty(m, inter, dtype=dtype)
                # The ops' in-place work on scratch copies, refreshed outside the timing
                # would cost as much as the op: time them in place (values drift, the
                # work does not).
                xs, rs, qs = x.clone(), res.clone(), qkv.clone()
                cases = [
                    ("rms_norm", lambda: ops.rms_norm(x, w, eps, out=out),
                     lambda: torch_norm(x, w),
                     lambda: (ops.rms_norm(x, w, eps), torch_norm(x, w))),
                    ("add + rms_norm", lambda: ops.fused_add_rms_norm(xs, rs, w, eps),
                     lambda: torch_norm(x + res, w),
                     lambda: (_fused(ops, x, res, w, eps), torch_norm(x + res, w))),
                    ("silu_and_mul", lambda: ops.silu_and_mul(gu, out=act),
                     lambda: F.silu(gu[:, :inter]) * gu[:, inter:],
                     lambda: (ops.silu_and_mul(gu), F.silu(gu[:, :inter]) * gu[:, inter:])),
                    ("rotary", lambda: ops.rotary_embedding(
                        pos, qs[:, :nq * d], qs[:, nq * d:(nq + nkv) * d], d, table, True),
                     lambda: torch_rotate(pos, qkv[:, :(nq + nkv) * d].view(m, nq + nkv, d), dtype),
                     lambda: (_rotary(ops, pos, qkv, nq, nkv, d, table),
                              torch_rotate(pos, qkv[:, :(nq + nkv) * d].view(m, nq + nkv, d),
                                           dtype).reshape(m, -1))),
                ]
                for name, ours_fn, peer_fn, check in cases:
                    a, b = check()
                    diff = float((a.double() - b.double()).abs().max()
                                 / b.double().abs().max().clamp_min(1e-30))
                    ours = time_us(ours_fn, target)
                    peer = time_us(peer_fn, target)
                    lines.append(f"| {dname} | {name} | {m} | {ours:.1f} | {peer:.1f} | "
                                 f"{peer / ours:.2f} | {diff:.1e} |")
                    log.info("%s %s rows %d: ours %.1f us, torch %.1f us", dname, name, m,
                             ours, peer)
    lines += ["", "Speedup: torch eager time / vllm_lite time (above 1: the native op is faster)."]
    return "\n".join(lines) + "\n"


def _fused(ops: Any, x: Any, res: Any, w: Any, eps: float) -> Any:
    xi, ri = x.clone(), res.clone()
    ops.fused_add_rms_norm(xi, ri, w, eps)
    return xi


def _rotary(ops: Any, pos: Any, qkv: Any, nq: int, nkv: int, d: int, table: Any) -> Any:
    q = qkv.clone()
    ops.rotary_embedding(pos, q[:, :nq * d], q[:, nq * d:(nq + nkv) * d], d, table, True)
    return q[:, :(nq + nkv) * d]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-lite bench elementwise",
                                description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    from .common import run_markdown_report

    return run_markdown_report("vllm-lite bench elementwise", run, args, "elementwise.md")


if __name__ == "__main__":
    sys.exit(main())
