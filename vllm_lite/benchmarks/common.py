"""What the throughput and latency benchmarks share: the model, dtype, device and thread
settings every engine runs with, and parsing helpers for their command lines."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from vllm_lite.benchmarks.report import DEFAULT_OUT

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def time_us(fn: Callable[[], Any], target_s: float) -> float:
    """Median microseconds of fn() over about target_s seconds of calls (at least 5),
    after 3 untimed ones."""
    for _ in range(3):
        fn()
    samples = []
    end = time.perf_counter() + target_s
    while time.perf_counter() < end or len(samples) < 5:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def int_range(text: str) -> tuple[int, int]:
    """``"100-1024"`` or ``"128"`` (a fixed length) as (min, max)."""
    try:
        parts = [int(x) for x in text.split("-")] if "-" in text else [int(text)] * 2
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX or N, got {text!r}") from None
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return parts[0], parts[1]


def int_list(text: str) -> list[int]:
    """``"8,16,32"`` as [8, 16, 32]; an empty string as []."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be positive, got {text!r}")
    return values


def size_help(sizes: dict[str, tuple[Any, Any]], key: str) -> str:
    """``(default X; --quick Y)`` for a help text, from a {key: (default, quick)} table."""
    def show(v: Any) -> str:
        if isinstance(v, tuple):
            return f"{v[0]}-{v[1]}"
        if isinstance(v, list):
            return ",".join(map(str, v))
        return str(v)
    default, quick = sizes[key]
    return f"(default {show(default)}; --quick {show(quick)})"


def apply_sizes(args: argparse.Namespace, sizes: dict[str, tuple[Any, Any]]) -> None:
    """Fills every size argument left unset with its default, or its --quick value."""
    for key, (default, quick) in sizes.items():
        if getattr(args, key, None) is None:
            setattr(args, key, quick if args.quick else default)


# The engine options the benchmarks take (flags generated from EngineArgs, its defaults and
# help); each is passed to every vllm_lite engine they build. The others are not offered
# (an unknown flag is refused): the benchmarks set them per run (max_model_len from the
# workload, no swap space, prefix caching off except in its own comparison), or they do not
# apply (token-id prompts need no tokenizer; no logprobs are asked for).
BENCH_ENGINE_OPTIONS = ("model", "dtype", "device", "seed", "kv_cache_space", "block_size",
                        "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                        "enable_chunked_prefill", "preemption_mode", "scheduling_policy",
                        "num_gpu_blocks_override", "quantization", "quantization_group_size",
                        "kv_cache_dtype", "enforce_eager")
# Those of them handed to LLM as they are (model, dtype, device are resolved in setup()).
_PASSED_THROUGH = BENCH_ENGINE_OPTIONS[3:]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of a benchmark's command line, as LLM keywords."""
    return {name: getattr(args, name) for name in _PASSED_THROUGH}


def add_common_arguments(p: argparse.ArgumentParser, kv_default: str | None = None) -> None:
    """The flags every engine benchmark shares. ``kv_default``: the default of
    --kv-cache-space when a benchmark sizes it itself (then the flag defaults to None)."""
    from vllm_lite.config import THREADS_HELP, EngineArgs

    helps = {
        "dtype": "weights and KV cache of every engine (auto resolved as vllm_lite does)",
        "seed": "workload seed, also vllm_lite's engine seed",
        "kv_cache_space": "GiB of vllm_lite's KV pool on the CPU (on a GPU the engine sizes "
                          "it from its gpu_memory_utilization); the HF peers get the same KV "
                          "memory",
        "max_num_seqs": "vllm_lite's batch limit (and generate_batch's "
                        "max_requests_per_batch)",
        "quantization": "vllm_lite's weight-only quantization (default: as the engine's, "
                        "gguf for a quantized GGUF on a CPU; none: the weights in --dtype); "
                        "the HF peers run the checkpoint's weights in --dtype",
    }
    defaults = {}
    if kv_default is not None:
        defaults["kv_cache_space"] = None
        helps["kv_cache_space"] += f" ({kv_default})"
    EngineArgs.add_cli_args(p, include=BENCH_ENGINE_OPTIONS, defaults=defaults, helps=helps)
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--quick", action="store_true",
                   help="a small workload that runs in a few minutes on 2 CPU cores")
    p.add_argument("--engines", default="vllm_lite,hf_generate,hf_generate_batch",
                   help="comma-separated subset of vllm_lite,hf_generate,hf_generate_batch "
                        "(and llama_cpp for bench throughput on the CPU)")
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
    engines: list[str]
    progress: bool
    # The weight-only method vllm_lite runs (--quantization resolved as the engine does:
    # None -> "gguf" for a quantized GGUF on a CPU), or None.
    quantization: str | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


def setup(args: argparse.Namespace, extra_engines: tuple[str, ...] = ()) -> BenchSetup:
    """Validates the shared arguments and applies the thread count (ValueError on bad
    input); ``extra_engines``: peers this benchmark runs besides engines.ENGINES."""
    from transformers import AutoConfig

    from vllm_lite.benchmarks.engines import ENGINES
    from vllm_lite.config import (check_quantization, resolve_device, resolve_dtype_name,
                                  resolve_quantization, set_threads)
    from vllm_lite.models import resolve_model
    from vllm_lite.models.gguf import gguf_source

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    known = (*ENGINES, *extra_engines)
    unknown = [e for e in engines if e not in known]
    if unknown or not engines:
        raise ValueError(f"--engines: unknown {unknown or 'empty list'}; choose from "
                         f"{', '.join(known)}")
    if "vllm_lite" not in engines:
        raise ValueError("--engines must include vllm_lite (the peers are compared with it)")
    device = resolve_device(args.device)
    set_threads(args.threads)
    if args.kv_cache_space <= 0:
        raise ValueError(f"--kv-cache-space must be > 0, got {args.kv_cache_space}")
    folder = resolve_model(args.model)
    hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    # One concrete dtype for every engine: HF's peers get what vllm_lite's "auto" picks.
    dtype_name = resolve_dtype_name(args.dtype, device.type, hf_config)
    source = gguf_source(args.model)
    quantization = resolve_quantization(check_quantization(args.quantization),
                                        None if source is None else str(source), hf_config,
                                        device.type)
    return BenchSetup(model=args.model, model_folder=Path(folder), hf_config=hf_config,
                      dtype_name=dtype_name, dtype=DTYPES[dtype_name], device=device,
                      threads=torch.get_num_threads(), engines=engines,
                      progress=not args.no_progress, quantization=quantization)


def run_cli(name: str, run: Callable[[argparse.Namespace], Any], args: argparse.Namespace,
            finish: Callable[[Any], None] | None = None) -> int:
    """Runs a benchmark from parsed arguments and hands its report to ``finish`` (default:
    an engine report, saved and summarized); bad arguments give a one-line error and exit
    status 2."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = run(args)
    except ValueError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    (finish or _save_and_summarize)(report)
    return 0


def run_markdown_report(name: str, run: Callable[[argparse.Namespace], str],
                        args: argparse.Namespace, filename: str) -> int:
    """run_cli for a benchmark whose report is one markdown text: written to
    ``args.out / filename`` and printed."""
    def finish(report: str) -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / filename).write_text(report)
        print(report)

    return run_cli(name, run, args, finish)


def _save_and_summarize(report: Any) -> None:
    from vllm_lite.benchmarks.report import print_summary

    report.save()
    print_summary(report)
