"""What the throughput and latency benchmarks share: the model, dtype, device and thread
settings every engine runs with, and parsing helpers for their command lines."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

from vllm_lite.benchmarks.report import DEFAULT_OUT

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def int_range(text: str) -> Tuple[int, int]:
    """``"100-1024"`` or ``"128"`` (a fixed length) as (min, max)."""
    try:
        parts = [int(x) for x in text.split("-")] if "-" in text else [int(text)] * 2
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX or N, got {text!r}") from None
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return parts[0], parts[1]


def int_list(text: str) -> List[int]:
    """``"8,16,32"`` as [8, 16, 32]; an empty string as []."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be positive, got {text!r}")
    return values


def size_help(sizes: Dict[str, Tuple[Any, Any]], key: str) -> str:
    """``(default X; --quick Y)`` for a help text, from a {key: (default, quick)} table."""
    def show(v: Any) -> str:
        if isinstance(v, tuple):
            return f"{v[0]}-{v[1]}"
        if isinstance(v, list):
            return ",".join(map(str, v))
        return str(v)
    default, quick = sizes[key]
    return f"(default {show(default)}; --quick {show(quick)})"


def apply_sizes(args: argparse.Namespace, sizes: Dict[str, Tuple[Any, Any]]) -> None:
    """Fills every size argument left unset with its default, or its --quick value."""
    for key, (default, quick) in sizes.items():
        if getattr(args, key, None) is None:
            setattr(args, key, quick if args.quick else default)


def add_common_arguments(p: argparse.ArgumentParser, kv_default: str = "4") -> None:
    from vllm_lite.models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"an alias ({DEFAULT_MODEL}), a .gguf file or an HF model folder")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="weights and KV cache of every engine")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every engine (default: torch's default, the cores)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--quick", action="store_true",
                   help="a small workload that runs in a few minutes on 2 CPU cores")
    p.add_argument("--engines", default="vllm_lite,hf_generate,hf_generate_batch",
                   help="comma-separated subset of vllm_lite,hf_generate,hf_generate_batch")
    p.add_argument("--kv-cache-space", type=float, default=4.0,
                   help="GiB of vllm_lite's KV pool on the CPU (on a GPU it takes 90%% of the "
                        f"free memory); the HF peers get the same KV memory ({kv_default})")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"results folder (default {DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


@dataclass
class BenchSetup:
    """The resolved settings every engine of one benchmark run shares."""

    model: str
    model_folder: Path
    hf_config: Any
    dtype_name: str
    dtype: torch.dtype
    device: torch.device
    threads: int
    engines: List[str]
    progress: bool

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


def setup(args: argparse.Namespace) -> BenchSetup:
    """Validates the shared arguments and applies the thread count (ValueError on bad
    input)."""
    from transformers import AutoConfig

    from vllm_lite.benchmarks.engines import ENGINES
    from vllm_lite.engine.config import resolve_device
    from vllm_lite.models import resolve_model

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise ValueError(f"--engines: unknown {unknown or 'empty list'}; choose from "
                         f"{', '.join(ENGINES)}")
    if "vllm_lite" not in engines:
        raise ValueError("--engines must include vllm_lite (the peers are compared with it)")
    device = resolve_device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.kv_cache_space <= 0:
        raise ValueError(f"--kv-cache-space must be > 0, got {args.kv_cache_space}")
    folder = resolve_model(args.model)
    hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    return BenchSetup(model=args.model, model_folder=Path(folder), hf_config=hf_config,
                      dtype_name=args.dtype, dtype=DTYPES[args.dtype], device=device,
                      threads=torch.get_num_threads(), engines=engines,
                      progress=not args.no_progress)


def run_cli(name: str, run: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> int:
    """Runs a benchmark from parsed arguments, saves and prints its report; bad arguments
    give a one-line error and exit status 2."""
    from vllm_lite.benchmarks.report import print_summary

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = run(args)
    except ValueError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    report.save()
    print_summary(report)
    return 0
