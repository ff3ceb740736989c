"""Fused MoE benchmark: the native op (``ops.fused_moe``) against the same block in torch ops.

For a mixture-of-experts block of a small real MoE's shape (default: 16 experts, top-2,
hidden 1024, intermediate 1408) and each token count, one run times on the CPU (or, with
``--device cuda``, on the GPU: the op's CUDA kernels, tensor cores for 16-bit dtypes on
sm_80+, against the same torch block on cuBLAS; no quantized columns there):

- ``op``: ``FusedMoE`` after ``prepare_for_cpu``, i.e. ``torch.ops.vllm_lite.fused_moe`` on
  the weights packed per expert where the selected CPU build has packed_linear's kernels for
  the dtype (AVX-512 float32, AVX512-BF16 / AMX bfloat16), else on the plain weights (the
  AVX2 expert GEMM for float32 experts of a few rows and every bfloat16 one, ATen for the
  rest): the reference of the ratio;
- ``torch``: ``layers.moe.fused_moe_torch``, the block in torch ops (softmax / topk, a
  stable argsort by expert, index_select, per expert F.linear + silu_and_mul + F.linear,
  index_add_), which the layer ran before the op;
- ``int8`` / ``int4``: the quantized experts (``quantize_model`` on the layer:
  ``layers.moe.SplitExperts``, the same routing and grouping, each chosen expert's two
  projections through ``int8_linear`` / ``int4_linear``, group --int4-group), with
  --quantized (default on). Their error columns are against float64 on their own
  dequantized weights.

Each cell is the median of timed calls after a warm-up (on the GPU each call synchronised),
with the weights in the caches they fit. The error columns compare both with a float64
computation on the CPU on the same (rounded) inputs, relative to the largest output, over
the first ERROR_ROWS tokens (routing is per token, so those rows are the whole check for
them). Writes ``moe.md`` to --out and prints it.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/moe.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import logging
import sys
from pathlib import Path

from . import RESULTS_DIR
from .common import time_us
from .report import cpu_name
from vllm_lite.config import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES, THREADS_HELP, set_threads

log = logging.getLogger(__name__)

DEFAULT_TOKENS = (1, 16, 256)
# Tokens whose outputs the error columns check against float64 (the CPU's float64 block
# for thousands of tokens of a large shape would take longer than the timing).
ERROR_ROWS = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=int, default=16, help="experts (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=1408,
                   help="each expert's intermediate size (default: %(default)s)")
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS),
                   help="tokens per call (default: %(default)s)")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "float16"),
                   default=["float32", "bfloat16"], help="(default: %(default)s)")
    p.add_argument("--target-s", type=float, default=1.0,
                   help="seconds of timed calls per cell (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the block runs (default: %(default)s)")
    p.add_argument("--quantized", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the int8 / int4 quantized experts (default: on the CPU; "
                        "refused with --device cuda)")
    p.add_argument("--int4-group", type=int, default=DEFAULT_INT4_GROUP_SIZE,
                   choices=INT4_GROUP_SIZES, help="int4 group size (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR,
                   help="results folder (default: %(default)s)")


def _float64_moe(x, logits, w13, w2, top_k: int, renormalize: bool):
    import torch

    x, w13, w2 = x.double(), w13.double(), w2.double()
    weights, ids = torch.topk(torch.softmax(logits.double(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        proj = x[tok] @ w13[e].t()
        act = torch.nn.functional.silu(proj[:, :inter]) * proj[:, inter:]
        out.index_add_(0, tok, weights[tok, slot].unsqueeze(1) * (act @ w2[e].t()))
    return out


def _dequantized(layer):
    """A quantized expert projection's weight [N, K] in float32."""
    from vllm_lite.layers.quantization import Int8Linear, dequantize_int8
    from vllm_lite.models.gguf_quant import Int4Weight

    if isinstance(layer, Int8Linear):
        return dequantize_int8(layer.qweight_rows(), layer.scales)
    return Int4Weight(layer.qweight_rows(), layer.scales, layer.zeros, layer.group_size,
                      layer.perm).dequantize()


def run(args: argparse.Namespace) -> str:
    """The report (markdown) of one run."""
    import torch

    from vllm_lite import ops
    from vllm_lite.layers.moe import FusedMoE, fused_moe_torch
    from vllm_lite.layers.quantization import quantize_model

    set_threads(args.threads)
    if min(args.tokens) < 1:
        raise ValueError("--tokens must be >= 1")
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    if not 1 <= e <= ops.MOE_MAX_NUM_EXPERTS:
        raise ValueError(f"--experts must be in [1, {ops.MOE_MAX_NUM_EXPERTS}], got {e}")
    if not 1 <= k <= min(e, ops.MOE_MAX_TOP_K):
        raise ValueError(f"--top-k must be in [1, min(--experts, {ops.MOE_MAX_TOP_K})], got {k}")
    if h < 1 or i < 1:
        raise ValueError(f"--hidden and --intermediate must be >= 1, got {h} and {i}")
    if args.target_s <= 0:
        raise ValueError(f"--target-s must be > 0, got {args.target_s}")
    cuda = args.device == "cuda"
    if cuda and args.quantized:
        raise ValueError("--quantized: the quantized experts run on the CPU only; use "
                         "--no-quantized with --device cuda")
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no GPU "
                         "(torch.cuda.is_available() is False)")
    if args.quantized is None:
        args.quantized = not cuda
    if args.quantized and (h % args.int4_group or i % args.int4_group):
        raise ValueError(f"--int4-group {args.int4_group} must divide --hidden ({h}) and "
                         f"--intermediate ({i}) for the int4 column (or --no-quantized)")
    gen = torch.Generator().manual_seed(args.seed)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        where = (f"on {props.name} (sm_{props.major}{props.minor}, torch {torch.__version__}, "
                 f"CUDA {torch.version.cuda})")
    else:
        where = (f"on the CPU ({cpu_name()}, {torch.get_num_threads()} threads, CPU ISA "
                 f"{ops.cpu_isa()}, torch {torch.__version__})")
    lines = [
        f"# Fused MoE block {where}",
        "",
        f"{e} experts, top-{k} (renormalised), hidden {h}, intermediate {i}; weights in cache "
        f"as far as they fit ({e * 3 * h * i * 4 / 2**20:.0f} MiB in float32).",
        "",
    ]
    methods = ("int8", "int4") if args.quantized else ()
    head = ("| dtype | op GEMMs | tokens | op (us) | torch (us) | torch / op | op max rel err | "
            "torch max rel err |")
    rule = "|---|---|---|---|---|---|---|---|"
    for m in methods:
        head += f" {m} (us) | {m} / op | {m} max rel err |"
        rule += "---|---|---|"
    lines += [head, rule]
    def timed(fn):  # a GPU call is timed to its end
        if not cuda:
            return time_us(fn, args.target_s)
        return time_us(lambda: (fn(), torch.cuda.synchronize()), args.target_s)

    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    with torch.inference_mode():
        for name in args.dtypes:
            dtype = getattr(torch, name)
            layer = FusedMoE(h, e, k, i, renormalize=True).to(dtype)
            layer.w13_weight.copy_(w13)
            layer.w2_weight.copy_(w2)
            if cuda:
                layer.to("cuda")
                gemms = "CUDA"
            else:
                layer.prepare_for_cpu()
                gemms = ("packed_linear" if layer._packed is not None
                         else "AVX2 few-rows / ATen" if ops.cpu_isa() != "generic"
                         and dtype != torch.float16 else "ATen")
            p13, p2 = layer.w13_weight, layer.w2_weight
            quantized = {}
            for m in methods:
                holder = torch.nn.Module()
                holder.experts = FusedMoE(h, e, k, i, renormalize=True).to(dtype)
                holder.experts.w13_weight.copy_(w13)
                holder.experts.w2_weight.copy_(w2)
                quantize_model(holder, m, group_size=args.int4_group)
                split = holder.experts
                # Its own weights for the error: each expert's projections dequantized.
                d13 = torch.stack([_dequantized(split.expert(x).gate_up_proj) for x in range(e)])
                d2 = torch.stack([_dequantized(split.expert(x).down_proj) for x in range(e)])
                quantized[m] = (split, d13, d2)
            for t in args.tokens:
                x = torch.randn(t, h, generator=gen).to(dtype)
                # Distinct logits (multiples of 1/4, exact in every dtype): no tie for the
                # op and the float64 reference to break differently.
                logits = (torch.argsort(torch.rand(t, e, generator=gen), dim=-1) * 0.25).to(dtype)
                x, logits = x.to(args.device), logits.to(args.device)
                ours = timed(lambda: layer(x, logits))
                theirs = timed(lambda: fused_moe_torch(x, logits, p13, p2, k, True))
                n = min(t, ERROR_ROWS)
                ref = _float64_moe(x[:n].cpu(), logits[:n].cpu(), p13.cpu(), p2.cpu(), k, True)
                scale = ref.abs().max().clamp_min(1e-30)
                err = float((layer(x, logits)[:n].cpu().double() - ref).abs().max() / scale)
                err_t = float((fused_moe_torch(x, logits, p13, p2, k, True)[:n].cpu().double()
                               - ref).abs().max() / scale)
                row = (f"| {name} | {gemms} | {t} | {ours:.0f} | {theirs:.0f} | "
                       f"{theirs / ours:.2f} | {err:.1e} | {err_t:.1e} |")
                for m, (split, d13, d2) in quantized.items():
                    q_us = time_us(lambda: split(x, logits), args.target_s)
                    q_ref = _float64_moe(x[:n], logits[:n], d13, d2, k, True)
                    q_err = float((split(x, logits)[:n].double() - q_ref).abs().max()
                                  / q_ref.abs().max().clamp_min(1e-30))
                    row += f" {q_us:.0f} | {q_us / ours:.2f} | {q_err:.1e} |"
                lines.append(row)
                log.info("%s tokens %d: op %.0f us, torch %.0f us", name, t, ours, theirs)
    lines += ["", "torch / op (int8 / op, int4 / op): how many times longer that block takes "
              "than the float op (above 1: the op is faster). Errors: relative to the largest "
              "output, against float64 on the same rounded inputs; bf16 outputs carry their "
              "own rounding (2^-9)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 benchmarks/moe.py",
                                description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    from .common import run_markdown_report

    return run_markdown_report("benchmarks/moe.py", run, args, "moe.md")


if __name__ == "__main__":
    sys.exit(main())
