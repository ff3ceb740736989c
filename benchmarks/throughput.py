"""Offline throughput: vllm_lite against Hugging Face transformers on one seeded workload.

    python3 benchmarks/throughput.py [--quick] [--dtype bfloat16] [--threads 2] [--out DIR]
    vllm-lite bench throughput ...                     (the same, from an installed package)

Every engine gets the same model, dtype, thread count and requests (token-id prompts,
greedy, EOS ignored, each request with its own output length):

- vllm_lite: all requests queued at once, continuous batching over the paged KV cache;
- hf_generate: ``model.generate`` on static left-padded batches (``--hf-batch-size``) in
  workload order; only each request's own tokens count as output;
- hf_generate_batch: HF's continuous batching (the manager behind ``generate_batch``).

``--random-model NAME`` runs a seeded random-weight model of a named shape
(benchmarks/random_models.py; e.g. ``moe-16x1024``, a mixture of experts) instead of
``--model``. Then vllm_lite alone: a block-size sweep and a max_num_seqs sweep (on the first
``--sweep-requests`` requests), and prefix caching off/on over a workload whose prompts
share prefixes. KV waste: the step-averaged fraction of handed-out KV slots that hold no
live token (vllm_lite: read from the block manager after every step; HF static: its
preallocated padded cache). Writes ``<out>/throughput_<device>_<dtype>_<time>.md`` with
``.json`` and PNG figures beside it.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/throughput.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import functools
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from vllm_lite.config import EngineArgs
from . import engines as E
from . import random_models
from .common import (BenchSetup, add_common_arguments, apply_sizes,
                     engine_options, int_list, int_range, run_cli, setup,
                     size_help)
from .report import (Report, describe_machine, fmt, machine_info,
                     make_report, markdown_table, pct)
from .workload import BenchRequest, WorkloadConfig, make_workload

logger = logging.getLogger(__name__)

# (default, --quick) of every size argument left unset on the command line.
SIZES: dict[str, tuple[Any, Any]] = {
    "num_requests": (256, 32),
    "input_len": ((100, 1024), (32, 256)),
    "output_len": ((100, 1024), (32, 256)),
    # The quick workload is the default scaled down, its KV budget with it: about the
    # same share of the workload's tokens fits at once (memory pressure), so the static
    # batches and the paged pool face the same trade-off as in the default run.
    "kv_cache_space": (EngineArgs.kv_cache_space, 0.125),
    "sweep_requests": (64, 16),
    "block_size_sweep": ([8, 16, 32], [8, 16, 32]),
    "max_num_seqs_sweep": ([16, 64, 256], [4, 16]),
    "prefix_requests": (64, 16),
    "prefix_len": (512, 256),
    "num_prefixes": (4, 2),
    "prefix_input_len": ((16, 128), (16, 64)),
    "prefix_output_len": ((16, 128), (16, 32)),
}

def goal(text: str) -> tuple[str, float]:
    """``ENGINE=RATIO`` (``--goal``): vllm_lite's output tokens/s at least RATIO x ENGINE's."""
    name, sep, value = text.partition("=")
    try:
        ratio = float(value)
    except ValueError:
        ratio = math.nan
    if not sep or not 0 < ratio < math.inf:
        raise argparse.ArgumentTypeError(f"expected ENGINE=RATIO with RATIO > 0, got {text!r}")
    peers = [e for e in (*E.ENGINES, E.LLAMA_CPP) if e != E.VLLM_LITE]
    if name not in peers:
        raise argparse.ArgumentTypeError(f"unknown engine {name!r} in {text!r} (one of "
                                         f"{', '.join(peers)})")
    return name, ratio


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, kv_default=size_help(SIZES, "kv_cache_space")[1:-1])

    def both(key: str) -> str:
        return size_help(SIZES, key)

    p.add_argument("--goal", type=goal, action="append", default=[], metavar="ENGINE=RATIO",
                   help="report whether vllm_lite's output tokens/s is at least RATIO x "
                        "ENGINE's (repeatable; the project's goals are in the README); none "
                        "by default")
    p.add_argument("--goal-kv-waste", type=fraction, default=None, metavar="FRACTION",
                   help="report whether vllm_lite's KV waste stays under FRACTION "
                        "(default: no goal)")
    p.add_argument("--num-requests", type=int, help=f"requests {both('num_requests')}")
    p.add_argument("--input-len", type=int_range, help=f"prompt lengths MIN-MAX {both('input_len')}")
    p.add_argument("--output-len", type=int_range,
                   help=f"output lengths MIN-MAX {both('output_len')}")
    p.add_argument("--hf-batch-size", type=int,
                   help="hf_generate's static batch (default: the most rows whose padded "
                        "cache fits in vllm_lite's KV pool, at most --max-num-seqs)")
    p.add_argument("--sweep-requests", type=int,
                   help=f"requests of the sweeps, the workload's first ones {both('sweep_requests')}")
    p.add_argument("--block-size-sweep", type=int_list,
                   help=f"block sizes to sweep, '' for none {both('block_size_sweep')}")
    p.add_argument("--max-num-seqs-sweep", type=int_list,
                   help=f"max_num_seqs values to sweep, '' for none {both('max_num_seqs_sweep')}")
    p.add_argument("--prefix-requests", type=int,
                   help=f"requests of the prefix-caching workload, 0 for none {both('prefix_requests')}")
    p.add_argument("--prefix-len", type=int, help=f"shared prefix length {both('prefix_len')}")
    p.add_argument("--num-prefixes", type=int, help=f"distinct shared prefixes {both('num_prefixes')}")
    p.add_argument("--prefix-input-len", type=int_range,
                   help=f"each prompt's own part after the prefix {both('prefix_input_len')}")
    p.add_argument("--prefix-output-len", type=int_range,
                   help=f"outputs of the prefix workload {both('prefix_output_len')}")
    p.add_argument("--hf-timeout", type=float, default=1800.0,
                   help="seconds generate_batch may take before it is reported as n/a")
    p.add_argument("--llama-cpp-bin", default=None,
                   help="folder of llama-server (engine llama_cpp; default: the newest build "
                        "of benchmarks/peers/llama_cpp.sh)")
    p.add_argument("--llama-cpp-slots", type=int, default=None,
                   help="llama-server's parallel slots (-np; default: --max-num-seqs, at "
                        "most the number of requests)")
    p.add_argument("--tensor-parallel-size", type=int_list, default=None,
                   help="vllm_lite's tensor_parallel_size; several (1,2) run the main workload "
                        "once each, the first as the reference of the engines table (default: "
                        "the engine's, %d)" % EngineArgs.tensor_parallel_size)
    p.add_argument("--random-model", default=None, metavar="NAME",
                   help="run a seeded random-weight model of a named shape instead of --model "
                        "(written once under $VLLM_LITE_CACHE/random-models): "
                        + "; ".join(f"{n}: {random_models.SHAPES[n][2]}"
                                    for n in random_models.SHAPES))
    p.add_argument("--no-sweeps", action="store_true",
                   help="skip the block-size, max_num_seqs and prefix-caching runs")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each engine in the engines and tensor-parallel "
                        "tables, back to back on the warmed-up engine; the tables show the "
                        "run with the median time, the JSON every run's tok/s (the sweeps "
                        "run once; default 1)")


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fills the size arguments left unset, then checks them (ValueError)."""
    apply_sizes(args, SIZES)
    if not args.tensor_parallel_size:
        args.tensor_parallel_size = [EngineArgs.tensor_parallel_size]
    if any(tp < 1 for tp in args.tensor_parallel_size):
        raise ValueError(f"--tensor-parallel-size values must be >= 1, got "
                         f"{args.tensor_parallel_size}")
    if args.no_sweeps:
        args.block_size_sweep, args.max_num_seqs_sweep, args.prefix_requests = [], [], 0
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    for key in ("num_requests", "sweep_requests", "block_size", "max_num_seqs", "repeats"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.prefix_requests < 0 or args.prefix_len < 0 or args.num_prefixes < 1:
        raise ValueError("--prefix-requests and --prefix-len must be >= 0, --num-prefixes >= 1")


# -- the runs ------------------------------------------------------------------------------------
def _warmup_requests(vocab_size: int) -> list[BenchRequest]:
    return make_workload(WorkloadConfig(num_requests=2, input_len=(8, 16), output_len=(4, 4),
                                        seed=12345), vocab_size)


def _max_model_len(s: BenchSetup, *workloads: Sequence[BenchRequest]) -> int | None:
    """The workload's longest sequence, capped by the model: a smaller max_model_len keeps
    the default token budget (and a GPU profiling pass) from being sized for 8k contexts."""
    longest = max(r.prompt_len + r.output_len for w in workloads for r in w)
    limit = getattr(s.hf_config, "max_position_embeddings", None)
    return min(max(longest, 2048), limit) if limit else None


def run_vllm_lite_config(s: BenchSetup, requests: Sequence[BenchRequest], args: argparse.Namespace,
                         max_model_len: int | None, label: str = E.VLLM_LITE,
                         primer: Sequence[BenchRequest] = (), repeats: int = 1,
                         **overrides: Any) -> E.RunResult:
    """A fresh LLM with ``overrides``, warmed up, then ``primer`` run untimed, then the
    timed run over ``requests`` (``repeats`` of them: E.median_run)."""
    kw = dict(engine_options(args), enable_prefix_caching=False,
              tensor_parallel_size=args.tensor_parallel_size[0])
    kw.update(overrides)
    if s.device.type == "cpu":
        # kv_cache_space is per rank: split it, so every size schedules the same KV pool.
        kw["kv_cache_space"] = kw["kv_cache_space"] / kw["tensor_parallel_size"]
    llm = E.build_llm(s.model, s.dtype_name, str(s.device), max_model_len=max_model_len,
                      **kw)
    try:
        E.run_vllm_lite(llm, _warmup_requests(s.vocab_size), track_kv=False)
        if kw["enable_prefix_caching"]:
            # The warm-up's blocks must not count as hits of the timed run.
            llm.llm_engine.reset_prefix_cache()
        if primer:
            E.run_vllm_lite(llm, primer, track_kv=False)
        executor = llm.llm_engine.executor
        comm_before = getattr(executor, "comm_seconds", 0.0)
        result = E.median_run(functools.partial(E.run_vllm_lite, llm, requests,
                                                progress=s.progress, label=label), repeats)
        result.settings["tensor_parallel_size"] = kw["tensor_parallel_size"]
        # Rank 0's seconds in the all-reduces and the logits gather, per timed run.
        result.settings["comm_s"] = (getattr(executor, "comm_seconds", 0.0)
                                     - comm_before) / repeats
        return result
    finally:
        llm.shutdown()
        del llm
        E.release_memory(s.device)


def run_hf(s: BenchSetup, requests: Sequence[BenchRequest], args: argparse.Namespace,
           kv_budget_bytes: int,
           on_result: Callable[[list[E.RunResult]], Any] = lambda results: None,
           ) -> list[E.RunResult]:
    """The HF peers with vllm_lite's KV memory: hf_generate's batch is the most rows its
    padded cache fits in (unless --hf-batch-size), generate_batch gets as many pages (on
    the CPU; on a GPU it sizes its cache from free memory, as vllm_lite does)."""
    results = []
    batch = args.hf_batch_size or E.equal_memory_batch_size(
        requests, kv_budget_bytes, E.kv_bytes_per_token(s.hf_config, s.dtype), args.max_num_seqs)
    cb_budget = kv_budget_bytes if s.device.type == "cpu" else None
    model = E.load_hf_model(s.model_folder, s.dtype, s.device)
    try:
        warm = _warmup_requests(s.vocab_size)
        if E.HF_STATIC in s.engines:
            def static() -> E.RunResult:
                E.run_hf_static(model, warm, batch)
                res = E.median_run(lambda: E.run_hf_static(
                    model, requests, batch, progress=s.progress), args.repeats)
                res.settings["batch_rule"] = ("--hf-batch-size" if args.hf_batch_size else
                                              "fits vllm_lite's KV pool")
                return res
            results.append(_guarded(E.HF_STATIC, len(requests), static))
            on_result(results)
        if E.HF_CONTINUOUS in s.engines:
            def continuous() -> E.RunResult:
                E.run_hf_continuous(model, warm, cb_budget, args.max_num_seqs,
                                    timeout_s=args.hf_timeout)
                return E.median_run(lambda: E.run_hf_continuous(
                    model, requests, cb_budget, args.max_num_seqs, progress=s.progress,
                    timeout_s=args.hf_timeout), args.repeats)
            results.append(_guarded(E.HF_CONTINUOUS, len(requests), continuous))
            on_result(results)
    finally:
        model = None  # the closures share this cell: the model is freed here
        E.release_memory(s.device)
    return results


def _guarded(engine: str, num_requests: int, fn: Any) -> E.RunResult:
    """A peer that fails or is interrupted (Ctrl-C, or SIGINT from a time limit) becomes
    an n/a row with the reason; the report of what did run is still written."""
    try:
        return fn()
    except KeyboardInterrupt:
        logger.warning("%s interrupted; the report is written without it", engine)
        return E.RunResult(engine, num_requests, error="interrupted (time limit or Ctrl-C)")
    except Exception as e:  # out of memory, an API change in transformers, ...
        logger.exception("%s failed", engine)
        return E.RunResult(engine, num_requests, error=f"{type(e).__name__}: {e}")


def run(args: argparse.Namespace) -> Report:
    resolve_sizes(args)
    if args.random_model is not None:
        if args.model != EngineArgs.model:
            raise ValueError(f"--random-model {args.random_model} and --model {args.model} "
                             "name different models; give one")
        args.model = str(random_models.materialize(args.random_model, args.seed))
    s = setup(args, extra_engines=(E.LLAMA_CPP,))
    info = machine_info(s.device, s.threads)
    wl = WorkloadConfig(num_requests=args.num_requests, input_len=args.input_len,
                        output_len=args.output_len, seed=args.seed)
    requests = make_workload(wl, s.vocab_size)
    sweep_requests = requests[:args.sweep_requests]
    prefix_wl = prefix_requests = None
    if args.prefix_requests:
        prefix_wl = WorkloadConfig(num_requests=args.prefix_requests, input_len=args.prefix_input_len,
                                   output_len=args.prefix_output_len, seed=args.seed + 1,
                                   shared_prefix_len=args.prefix_len, num_prefixes=args.num_prefixes)
        prefix_requests = make_workload(prefix_wl, s.vocab_size)
    max_len = _max_model_len(s, requests, prefix_requests or [])
    logger.info("throughput: %s; %s %s on %s, %d threads", wl.describe(), s.model, s.dtype_name,
                s.device, s.threads)

    stem = make_report("", "throughput", args.out, s.device, s.dtype_name).stem
    bs_sweep: list[E.RunResult] = []
    seqs_sweep: list[E.RunResult] = []
    prefix_runs: list[E.RunResult] = []
    tp_runs: list[E.RunResult] = []

    def snapshot(peers: Sequence[E.RunResult], final: bool = False) -> Report:
        """The report of what has run so far; saved at once unless final (a run cut
        short, or killed, still leaves its tables behind)."""
        if final:
            info["load_avg_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
        rep = Report("Throughput: vllm_lite vs HF transformers", Path(args.out), stem)
        write_report(rep, s, info, wl, args, main, peers, bs_sweep, seqs_sweep, prefix_wl,
                     prefix_runs, figures=final, tp_runs=tp_runs)
        if not final:
            rep.save()
        return rep

    main = run_vllm_lite_config(s, requests, args, max_len, repeats=args.repeats)
    snapshot([])
    for tp in args.tensor_parallel_size[1:]:
        tp_runs.append(run_vllm_lite_config(s, requests, args, max_len,
                                            tensor_parallel_size=tp, repeats=args.repeats,
                                            label=f"vllm_lite tp={tp}"))
    for bs in args.block_size_sweep:
        bs_sweep.append(run_vllm_lite_config(s, sweep_requests, args, max_len, block_size=bs))
    for n in args.max_num_seqs_sweep:
        seqs_sweep.append(run_vllm_lite_config(s, sweep_requests, args, max_len, max_num_seqs=n))
    if prefix_requests:
        # Requests prefilled in the same step cannot hit each other's blocks (a block is
        # published once computed), so each prefix is computed once first, as a server's
        # system prompt would be: the timed run measures the steady state.
        primer = [BenchRequest(r.prompt_token_ids[:args.prefix_len], 1)
                  for r in prefix_requests[:args.num_prefixes]] if args.prefix_len else []
        for caching in (False, True):
            prefix_runs.append(run_vllm_lite_config(
                s, prefix_requests, args, max_len, enable_prefix_caching=caching, primer=primer,
                label=f"prefix caching {'on' if caching else 'off'}"))
    if bs_sweep or seqs_sweep or prefix_runs:
        snapshot([])
    peers = run_hf(s, requests, args, main.settings["kv_pool_bytes"], snapshot) \
        if {E.HF_STATIC, E.HF_CONTINUOUS} & set(s.engines) else []
    if E.LLAMA_CPP in s.engines:
        peers.append(_guarded(E.LLAMA_CPP, len(requests),
                              lambda: run_llama_cpp_peer(s, requests, args, stem)))
    return snapshot(peers, final=True)


def run_llama_cpp_peer(s: BenchSetup, requests: Sequence[BenchRequest],
                       args: argparse.Namespace, stem: str) -> E.RunResult:
    """llama-server on the GGUF of this run's precision (benchmarks/llama_cpp.py)."""
    from . import llama_cpp
    from vllm_lite.models.gguf import gguf_source

    if s.device.type != "cpu":
        raise ValueError("engine llama_cpp runs on the CPU only (benchmarks/peers/llama_cpp.sh "
                         "builds it without GPU support)")
    bin_dir = llama_cpp.find_bin(args.llama_cpp_bin)
    precision = s.quantization or s.dtype_name
    source = gguf_source(s.model) if precision == "gguf" else None
    # Kept blocks: the very file vllm_lite keeps (the alias's own Q4_1, or a user's Q8_0
    # GGUF); other precisions: the conversions next to the build.
    gguf = Path(source) if source is not None else llama_cpp.model_file(bin_dir, precision)
    log_path = Path(args.out) / f"{stem}_llama_server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return llama_cpp.run_llama_cpp(bin_dir, gguf, requests, s.threads,
                                   args.llama_cpp_slots or args.max_num_seqs, log_path,
                                   progress=s.progress, precision=precision,
                                   repeats=args.repeats)


# -- the report ------------------------------------------------------------------------------------
def _speedup(main: E.RunResult, peer: E.RunResult) -> float | None:
    if not peer.ok or not peer.output_tokens_per_s:
        return None
    return main.output_tokens_per_s / peer.output_tokens_per_s


def _engine_rows(main: E.RunResult, peers: Sequence[E.RunResult]) -> list[list[Any]]:
    rows = []
    for r in [main, *peers]:
        if not r.ok:
            rows.append([r.engine, r.num_requests, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a",
                         "n/a", "n/a", "n/a", f"n/a: {r.error}"])
            continue
        speed = "1 (reference)" if r is main else fmt(_speedup(main, r))
        notes = [r.note] if r.note else []
        if r.engine == E.HF_STATIC:
            notes.insert(0, f"batch {r.settings['batch_size']} ({r.settings.get('batch_rule', '')})")
        elif r.engine == E.LLAMA_CPP:
            notes.insert(0, f"{r.settings['gguf']}, {r.settings['slots']} slots, unified KV "
                            f"of {r.settings['ctx_tokens']} tokens")
        elif r.engine == E.HF_CONTINUOUS:
            notes.insert(0, f"{r.settings.get('num_blocks') or 'auto'} pages of "
                            f"{r.settings.get('page_size')} tokens")
        elif r.num_preemptions:
            notes.insert(0, f"{r.num_preemptions} preemptions (recompute)")
        rows.append([
            r.engine, r.num_requests, r.output_tokens, r.generated_tokens, fmt(r.elapsed_s),
            fmt(r.output_tokens_per_s), fmt(r.requests_per_s), speed,
            pct(r.kv.waste) if r.kv else "n/a", fmt(r.kv.peak_allocated_mib) if r.kv else "n/a",
            fmt(r.cpu_share, 2), "; ".join(notes),
        ])
    return rows


def _sweep_rows(results: Sequence[E.RunResult], key: str) -> list[list[Any]]:
    return [[r.settings[key], r.num_requests, r.output_tokens, fmt(r.elapsed_s),
             fmt(r.output_tokens_per_s), pct(r.kv.waste) if r.kv else "n/a",
             fmt(r.kv.peak_allocated_mib) if r.kv else "n/a", r.num_preemptions,
             fmt(r.cpu_share, 2)]
            for r in results]


def goals(main: E.RunResult, peers: Sequence[E.RunResult],
          args: argparse.Namespace) -> list[str]:
    """The goals given on the command line (--goal, --goal-kv-waste), each reported as
    met / missed, never asserted."""
    lines = []
    for engine, ratio_goal in args.goal:
        for peer in [p for p in peers if p.engine == engine] or [None]:
            ratio = None if peer is None else _speedup(main, peer)
            if ratio is None:
                why = "not run" if peer is None else peer.error
                lines.append(f"- vllm_lite vs {engine}: n/a ({why}); goal >= {ratio_goal}x")
            else:
                lines.append(f"- vllm_lite vs {engine}: {ratio:.2f}x output tokens/s (goal >= "
                             f"{ratio_goal}x): {'met' if ratio >= ratio_goal else 'MISSED'}")
    if args.goal_kv_waste is not None and main.kv is not None:
        status = "met" if main.kv.waste < args.goal_kv_waste else "MISSED"
        lines.append(f"- vllm_lite KV waste at block size {main.settings['block_size']}: "
                     f"{pct(main.kv.waste)} (goal < {pct(args.goal_kv_waste)}): {status}")
    return lines


def write_report(report: Report, s: BenchSetup, info: dict[str, Any], wl: WorkloadConfig,
                 args: argparse.Namespace, main: E.RunResult, peers: Sequence[E.RunResult],
                 bs_sweep: Sequence[E.RunResult], seqs_sweep: Sequence[E.RunResult],
                 prefix_wl: WorkloadConfig | None, prefix_runs: Sequence[E.RunResult],
                 figures: bool = True, tp_runs: Sequence[E.RunResult] = ()) -> None:
    model = (random_models.describe(args.random_model) if args.random_model else
             f"{s.model} ({s.model_folder.name})")
    report.add(f"Machine: {describe_machine(info)}.\n\n"
               f"Model {model}, {s.dtype_name}, quantization "
               f"{s.quantization or 'none'}, device {s.device}. "
               f"Workload: {wl.describe()}; greedy, EOS ignored; the same token-id prompts for "
               f"every engine. vllm_lite: block size {args.block_size}, max_num_seqs "
               f"{args.max_num_seqs}, KV pool {main.settings.get('num_kv_blocks')} blocks "
               f"({fmt(main.settings['kv_pool_bytes'] / 2**20)} MiB; the HF peers get the same "
               "KV memory).")
    report.add("## Engines\n\n" + markdown_table(
        ["engine", "requests", "output tokens", "generated tokens", "time (s)", "output tok/s",
         "req/s", "vllm_lite speedup", "KV waste", "peak KV (MiB)", "CPU share", "notes"],
        _engine_rows(main, peers)))
    report.add("CPU share: CPU time the process got / (wall time x threads); on a shared "
               "machine a run well below the others' share was slowed by other jobs. "
               "Output tokens are each request's own tokens; generated tokens add the "
               "padded and past-length rows of static batches. KV waste: step-averaged share "
               "of handed-out KV slots holding no live token (vllm_lite: blocks held by "
               "sequences vs their computed tokens, read after every step; hf_generate: a "
               "cache preallocated for rows x (longest prompt + most new tokens)). "
               "generate_batch's own cache is not measured (n/a).")
    if args.repeats > 1:
        runs = "; ".join(f"{r.engine}: " + ", ".join(fmt(v) for v in r.settings.get(
            "repeat_output_tok_s", [])) for r in [main, *peers] if r.ok)
        report.add(f"Each engine ran the workload {args.repeats} times back to back; the "
                   f"table shows its run with the median time. Output tok/s of every run, "
                   f"in order: {runs}.")
    goal_lines = goals(main, peers, args)  # the report and its JSON
    if goal_lines:
        report.add("### Goals (reported, not asserted)\n\n" + "\n".join(goal_lines))
    if tp_runs:
        rows = []
        for r in [main, *tp_runs]:
            tp = r.settings.get("tensor_parallel_size", 1)
            share = r.settings.get("comm_s", 0.0) / r.elapsed_s if r.ok and r.elapsed_s else None
            rows.append([tp, r.num_requests, r.output_tokens, fmt(r.elapsed_s),
                         fmt(r.output_tokens_per_s), fmt(_speedup(r, main)) if r is not main
                         else "1 (reference)", pct(share) if tp > 1 and share is not None
                         else "-"])
        report.add("## Tensor parallel (vllm_lite, the main workload)\n\n" + markdown_table(
            ["tensor_parallel_size", "requests", "output tokens", "time (s)", "output tok/s",
             "vs the first", "all-reduce share"], rows)
            + "\n\nall-reduce share: rank 0's seconds in the model's all-reduces and the "
              "logits gather / the run's wall time (waiting for a slower rank included). "
              "Each CPU rank gets cores / ranks threads and kv_cache_space / ranks, so every "
              "size has the same KV pool in blocks.")
    if bs_sweep:
        report.add(f"## Block size sweep (vllm_lite, first {bs_sweep[0].num_requests} requests)\n\n"
                   + markdown_table(["block size", "requests", "output tokens", "time (s)",
                                     "output tok/s", "KV waste", "peak KV (MiB)", "preemptions",
                                     "CPU share"],
                                    _sweep_rows(bs_sweep, "block_size")))
    if seqs_sweep:
        report.add(f"## max_num_seqs sweep (vllm_lite, first {seqs_sweep[0].num_requests} "
                   "requests)\n\n"
                   + markdown_table(["max_num_seqs", "requests", "output tokens", "time (s)",
                                     "output tok/s", "KV waste", "peak KV (MiB)", "preemptions",
                                     "CPU share"],
                                    _sweep_rows(seqs_sweep, "max_num_seqs")))
    if prefix_runs and prefix_wl is not None:
        off, on = prefix_runs
        speed = on.output_tokens_per_s / off.output_tokens_per_s if off.output_tokens_per_s else None
        rows = [[r.engine, r.num_requests, r.prompt_tokens, r.output_tokens, fmt(r.elapsed_s),
                 fmt(r.output_tokens_per_s), pct(r.prefix_hit_rate) if r is on else "-",
                 pct(r.kv.waste) if r.kv else "n/a", fmt(r.kv.peak_allocated_mib) if r.kv else "n/a",
                 fmt(r.cpu_share, 2)]
                for r in prefix_runs]
        report.add(f"## Prefix caching (vllm_lite)\n\nWorkload: {prefix_wl.describe()}. "
                   "Each prefix is computed once before the timed run (one untimed request "
                   "per prefix, both runs), as a server's shared system prompt would be.\n\n"
                   + markdown_table(["run", "requests", "prompt tokens", "output tokens",
                                     "time (s)", "output tok/s", "block hit rate", "KV waste",
                                     "peak KV (MiB)", "CPU share"], rows)
                   + f"\n\nSpeedup with prefix caching: {fmt(speed)}x (hit rate: full prompt "
                     "blocks found in the cache / looked up).")
    report.data = {
        "machine": info, "model": s.model, "random_model": args.random_model,
        "dtype": s.dtype_name, "device": str(s.device),
        "workload": wl.__dict__, "args": {k: v for k, v in vars(args).items() if k != "out"},
        "engines": [r.to_dict() for r in [main, *peers]],
        "block_size_sweep": [r.to_dict() for r in bs_sweep],
        "tensor_parallel": [r.to_dict() for r in tp_runs],
        "max_num_seqs_sweep": [r.to_dict() for r in seqs_sweep],
        "prefix_caching": {"workload": prefix_wl.__dict__ if prefix_wl else None,
                           "runs": [r.to_dict() for r in prefix_runs]},
        "goals": goal_lines,
    }
    if not figures:
        return
    title = f"{s.model} {s.dtype_name}, {s.device}, {s.threads} threads"
    report.figure("engines", lambda plt: plot_engines(plt, main, peers, title),
                  "output tokens/s and KV waste per engine")
    report.figure("kv", lambda plt: plot_kv(plt, [main, *peers]), "KV slots over the run")
    if bs_sweep or seqs_sweep or prefix_runs:
        report.figure("sweeps", lambda plt: plot_sweeps(plt, bs_sweep, seqs_sweep, prefix_runs),
                      "vllm_lite sweeps")


# -- figures --------------------------------------------------------------------------------------
def plot_engines(plt: Any, main: E.RunResult, peers: Sequence[E.RunResult], title: str) -> None:
    runs = [main, *peers]
    names = [r.engine for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    speeds = [r.output_tokens_per_s for r in runs]
    bars = ax1.bar(names, speeds, color=["tab:green", "tab:blue", "tab:orange"][:len(runs)])
    for bar, r in zip(bars, runs):
        label = "n/a" if not r.ok else ("" if r is main else f"{_speedup(main, r):.2f}x slower")
        ax1.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                     ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"throughput ({title})", fontsize=9)
    waste = [100 * r.kv.waste if r.kv else 0.0 for r in runs]
    bars = ax2.bar(names, waste, color="tab:red")
    for bar, r in zip(bars, runs):
        ax2.annotate(pct(r.kv.waste, 1) if r.kv else "n/a",
                     (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                     ha="center", va="bottom", fontsize=8)
    ax2.set_ylabel("KV slots holding no live token (%)")
    ax2.set_title("KV waste (step average)", fontsize=9)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)


def plot_kv(plt: Any, runs: Sequence[E.RunResult]) -> None:
    runs = [r for r in runs if r.kv is not None and r.kv.timeline]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.5), squeeze=False)
    for ax, r in zip(axes[0], runs):
        alloc = [a for a, _ in r.kv.timeline]
        live = [b for _, b in r.kv.timeline]
        steps = range(len(alloc))
        ax.fill_between(steps, alloc, color="tab:red", alpha=0.3, label="allocated")
        ax.fill_between(steps, live, color="tab:green", alpha=0.6, label="live")
        ax.set_title(f"{r.engine}: waste {pct(r.kv.waste, 1)}", fontsize=9)
        ax.set_xlabel("engine step")
        ax.set_ylabel("KV slots (tokens)")
        ax.legend(fontsize=8)


def _sweep_panel(ax: Any, runs: Sequence[E.RunResult], key: str, twin_label: str,
                 twin_values: list[float], twin_color: str) -> None:
    """Output tokens/s per setting (bars) and one more quantity on a second axis."""
    xs = [str(r.settings[key]) for r in runs]
    ax.bar(xs, [r.output_tokens_per_s for r in runs], color="tab:green")
    ax.set_xlabel(key.replace("_", " "))
    ax.set_ylabel("output tokens/s")
    ax.set_title(key.replace("_", " "), fontsize=9)
    twin = ax.twinx()
    twin.plot(xs, twin_values, "o-", color=twin_color)
    twin.set_ylabel(twin_label, color=twin_color)


def plot_sweeps(plt: Any, bs_sweep: Sequence[E.RunResult], seqs_sweep: Sequence[E.RunResult],
                prefix_runs: Sequence[E.RunResult]) -> None:
    panels = [p for p in (bs_sweep, seqs_sweep, prefix_runs) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), squeeze=False)
    axes = list(axes[0])
    if bs_sweep:
        _sweep_panel(axes.pop(0), bs_sweep, "block_size", "KV waste (%)",
                     [100 * r.kv.waste for r in bs_sweep], "tab:red")
    if seqs_sweep:
        _sweep_panel(axes.pop(0), seqs_sweep, "max_num_seqs", "peak KV (MiB)",
                     [r.kv.peak_allocated_mib for r in seqs_sweep], "tab:purple")
    if prefix_runs:
        ax = axes.pop(0)
        ax.bar([r.engine.replace("prefix caching ", "") for r in prefix_runs],
               [r.output_tokens_per_s for r in prefix_runs], color=["tab:gray", "tab:green"])
        hit = prefix_runs[-1].prefix_hit_rate
        ax.set_title(f"prefix caching (hit rate {pct(hit, 0)})", fontsize=9)
        ax.set_ylabel("output tokens/s")



def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/throughput.py",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_cli("throughput", run, args)


if __name__ == "__main__":
    sys.exit(main())
