"""Latency: vllm_lite against Hugging Face ``generate``.

    python3 benchmarks/latency.py [--quick] [--dtype bfloat16] [--threads 2] [--out DIR]
    vllm-lite bench latency ...                        (the same, from an installed package)

Two measurements, the same model, dtype, threads and token-id prompts for both engines
(greedy, EOS ignored):

1. Batch 1: one request of ``--prompt-len`` tokens generating ``--output-len`` tokens,
   ``--iters`` times after a warm-up: time to first token (TTFT), time per output token
   after the first (TPOT) and end-to-end latency.
2. Under a request rate: ``--num-requests`` requests arriving as a Poisson process of
   ``--request-rate`` requests/s (seeded). vllm_lite: each request is added to the
   LLMEngine when its arrival time has passed and the engine is stepped here, so every
   token's time is the end of the step that produced it. HF ``generate`` serves static
   batches of whatever has arrived (up to ``--hf-batch-size``, in arrival order) each
   time the previous batch is done; a streamer times every decoding step. TTFT counts
   from the request's arrival; percentiles p50/p95/p99 over requests (TTFT, TPOT,
   end-to-end) and over all gaps between tokens (ITL).

Writes ``<out>/latency_<device>_<dtype>_<time>.md`` with ``.json`` and a PNG beside it.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/latency.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import collections
import functools
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from . import engines as E
from .common import (BenchSetup, add_common_arguments, apply_sizes,
                     engine_options, int_range, run_cli, setup, size_help)
from .report import (Report, describe_machine, fmt, machine_info,
                     make_report, markdown_table, percentile)
from .workload import BenchRequest, WorkloadConfig, make_workload

logger = logging.getLogger(__name__)

SIZES: dict[str, tuple[Any, Any]] = {
    "prompt_len": (512, 128),
    "output_len": (128, 32),
    "iters": (10, 5),
    "num_requests": (64, 16),
    "request_rate": (2.0, 1.0),
    "rate_input_len": ((100, 512), (32, 256)),
    "rate_output_len": ((50, 256), (16, 64)),
    "hf_batch_size": (32, 16),
}
PERCENTILES = (50, 95, 99)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    p.set_defaults(engines="vllm_lite,hf_generate")

    def both(key: str) -> str:
        return size_help(SIZES, key)

    p.add_argument("--prompt-len", type=int, help=f"batch-1 prompt tokens {both('prompt_len')}")
    p.add_argument("--output-len", type=int, help=f"batch-1 output tokens {both('output_len')}")
    p.add_argument("--iters", type=int, help=f"batch-1 timed repetitions {both('iters')}")
    p.add_argument("--goal-ratio", type=positive_float, default=None, metavar="RATIO",
                   help="report whether vllm_lite's batch-1 end-to-end latency is at most "
                        "RATIO x HF generate's (default: no goal)")
    p.add_argument("--num-requests", type=int, help=f"requests of the rate run, 0 for none "
                                                     f"{both('num_requests')}")
    p.add_argument("--request-rate", type=float,
                   help=f"Poisson arrival rate, requests/s {both('request_rate')}")
    p.add_argument("--rate-input-len", type=int_range,
                   help=f"prompt lengths of the rate run {both('rate_input_len')}")
    p.add_argument("--rate-output-len", type=int_range,
                   help=f"output lengths of the rate run {both('rate_output_len')}")
    p.add_argument("--hf-batch-size", type=int,
                   help=f"largest static batch HF serves under the rate {both('hf_batch_size')}")


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fills the size arguments left unset, then checks them (ValueError)."""
    apply_sizes(args, SIZES)
    for key in ("prompt_len", "output_len", "iters", "hf_batch_size", "max_num_seqs", "block_size"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.num_requests < 0:
        raise ValueError(f"--num-requests must be >= 0, got {args.num_requests}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")


# -- timings --------------------------------------------------------------------------------------
@dataclass
class RequestTiming:
    """When a request arrived and when each of its output tokens appeared (seconds from the
    run's start)."""

    arrival: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.token_times else None

    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class LatencyResult:
    engine: str
    timings: list[RequestTiming]
    duration_s: float
    note: str = ""
    # CPU time / (wall time x threads) over the run (engines.CpuShare); None on a GPU.
    cpu_share: float | None = None

    @property
    def output_tokens(self) -> int:
        return sum(len(t.token_times) for t in self.timings)

    def stats(self) -> dict[str, dict[str, float | None]]:
        """Percentiles (seconds) of TTFT, TPOT, E2E over requests and ITL over gaps."""
        series = {
            "ttft": [t.ttft for t in self.timings if t.ttft is not None],
            "tpot": [t.tpot for t in self.timings if t.tpot is not None],
            "itl": [g for t in self.timings for g in t.gaps()],
            "e2e": [t.e2e for t in self.timings if t.e2e is not None],
        }
        out: dict[str, dict[str, float | None]] = {}
        for name, values in series.items():
            out[name] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
            out[name]["mean"] = sum(values) / len(values) if values else None
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "duration_s": self.duration_s,
                "output_tokens": self.output_tokens, "note": self.note, "stats": self.stats(),
                "cpu_share": self.cpu_share,
                "requests": [{"arrival": t.arrival, "token_times": t.token_times}
                             for t in self.timings]}


class _StepTimes:
    """A ``generate`` streamer that only records when each put happens: the first put is
    the prompt, each later one a decoding step's new tokens."""

    def __init__(self, clock_start: float) -> None:
        self.start = clock_start
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass


# -- vllm_lite --------------------------------------------------------------------------------------
_ids = iter(range(1 << 62))


def vllm_lite_serve(llm: Any, requests: Sequence[BenchRequest],
                    arrivals: Sequence[float]) -> LatencyResult:
    """Adds each request once its arrival time has passed and steps the engine; a token's
    time is the end of the step that produced it."""
    engine = llm.llm_engine
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    rids = {f"lat{next(_ids)}": i for i in order}
    by_index = {i: rid for rid, i in rids.items()}
    timings = [RequestTiming(arrivals[i]) for i in range(len(requests))]
    pending = collections.deque(order)
    finished = 0
    share = E.CpuShare()
    start = time.perf_counter()
    try:
        while finished < len(requests):
            now = time.perf_counter() - start
            while pending and arrivals[pending[0]] <= now:
                i = pending.popleft()
                engine.add_request(by_index[i], None, E.greedy_params(requests[i].output_len),
                                   prompt_token_ids=list(requests[i].prompt_token_ids))
            if not engine.has_unfinished_requests():
                if not pending:
                    raise RuntimeError("the engine stopped with requests unfinished")
                time.sleep(max(0.0, arrivals[pending[0]] - now))
                continue
            outs = engine.step()
            t = time.perf_counter() - start
            for out in outs:
                i = rids.get(out.request_id)
                if i is None:
                    continue
                times = timings[i].token_times
                times.extend([t] * (len(out.outputs[0].token_ids) - len(times)))
                if out.finished:
                    if getattr(out, "error", None):
                        raise RuntimeError(f"request {i} failed: {out.error}")
                    finished += 1
    except BaseException:
        engine.abort_request([*rids])
        raise
    return LatencyResult(E.VLLM_LITE, timings, time.perf_counter() - start,
                         cpu_share=share(engine.config.device))


# -- HF generate ------------------------------------------------------------------------------------
def hf_serve(model: Any, requests: Sequence[BenchRequest], arrivals: Sequence[float],
             batch_size: int) -> LatencyResult:
    """Static batches of whatever has arrived (arrival order, at most ``batch_size``),
    one after another; row i's k-th token appears at the batch's k-th decoding step."""
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    timings = [RequestTiming(arrivals[i]) for i in range(len(requests))]
    pending = collections.deque(order)
    share = E.CpuShare()
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        if arrivals[pending[0]] > now:
            time.sleep(arrivals[pending[0]] - now)
            continue
        batch = []
        while pending and len(batch) < batch_size and arrivals[pending[0]] <= now:
            batch.append(pending.popleft())
        streamer = _StepTimes(start)
        E.hf_generate(model, [requests[i] for i in batch], streamer=streamer)
        steps = streamer.times[1:]  # the first put is the prompt
        for i in batch:
            timings[i].token_times = steps[:requests[i].output_len]
    return LatencyResult(E.HF_STATIC, timings, time.perf_counter() - start,
                         note=f"static batches of what has arrived, up to {batch_size}",
                         cpu_share=share(model.device))


# -- the runs ------------------------------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def batch1(serve: Any, request: BenchRequest, iters: int) -> LatencyResult:
    """``iters`` timed single-request runs after one warm-up, merged into one result."""
    serve([request], [0.0])
    timings: list[RequestTiming] = []
    total = 0.0
    shares = []
    for _ in range(iters):
        res = serve([request], [0.0])
        timings.extend(res.timings)
        total += res.duration_s
        shares.append(res.cpu_share)
    share = sum(shares) / len(shares) if None not in shares else None
    return LatencyResult(res.engine, timings, total, note=res.note, cpu_share=share)


def run(args: argparse.Namespace) -> Report:
    resolve_sizes(args)
    s = setup(args)
    info = machine_info(s.device, s.threads)
    one = make_workload(WorkloadConfig(num_requests=1, input_len=(args.prompt_len,) * 2,
                                       output_len=(args.output_len,) * 2, seed=args.seed),
                        s.vocab_size)[0]
    rate_wl = WorkloadConfig(num_requests=max(1, args.num_requests), input_len=args.rate_input_len,
                             output_len=args.rate_output_len, seed=args.seed + 2)
    rate_requests = make_workload(rate_wl, s.vocab_size) if args.num_requests else []
    arrivals = poisson_arrivals(len(rate_requests), args.request_rate, args.seed + 3)
    longest = max([one.prompt_len + one.output_len]
                  + [r.prompt_len + r.output_len for r in rate_requests])
    limit = getattr(s.hf_config, "max_position_embeddings", None)
    max_len = min(max(longest, 2048), limit) if limit else None

    results: dict[str, dict[str, LatencyResult]] = {"batch1": {}, "rate": {}}
    llm = E.build_llm(s.model, s.dtype_name, str(s.device), max_model_len=max_len,
                      **engine_options(args))
    try:
        serve = functools.partial(vllm_lite_serve, llm)
        results["batch1"][E.VLLM_LITE] = batch1(serve, one, args.iters)
        if rate_requests:
            serve(rate_requests[:2], [0.0, 0.0])  # warm-up of batched steps
            results["rate"][E.VLLM_LITE] = serve(rate_requests, arrivals)
    finally:
        serve = llm = None
        E.release_memory(s.device)
    if E.HF_STATIC in s.engines:
        model = E.load_hf_model(s.model_folder, s.dtype, s.device)
        try:
            serve = functools.partial(hf_serve, model, batch_size=args.hf_batch_size)
            results["batch1"][E.HF_STATIC] = batch1(serve, one, args.iters)
            if rate_requests:
                serve(rate_requests[:2], [0.0, 0.0])
                results["rate"][E.HF_STATIC] = serve(rate_requests, arrivals)
        finally:
            serve = model = None
            E.release_memory(s.device)
    info["load_avg_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    report = make_report("Latency: vllm_lite vs HF generate", "latency", args.out, s.device,
                         s.dtype_name)
    write_report(report, s, info, args, one, rate_wl if rate_requests else None, results)
    return report


# -- the report ------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "n/a" if x is None else fmt(1000 * x)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def goal_line(b1: dict[str, LatencyResult], ratio: float | None) -> str | None:
    """--goal-ratio: vllm_lite's batch-1 end-to-end latency at most ratio x HF generate's."""
    ours, hf = b1.get(E.VLLM_LITE), b1.get(E.HF_STATIC)
    if ratio is None or ours is None or hf is None:
        return None
    a, b = ours.stats()["e2e"]["p50"], hf.stats()["e2e"]["p50"]
    if a is None or b is None:
        return None
    return (f"- batch-1 end-to-end latency, vllm_lite {_ms(a)} ms vs HF generate {_ms(b)} ms "
            f"(median; goal: at most {ratio}x HF's): {'met' if a <= ratio * b else 'MISSED'}")


def write_report(report: Report, s: BenchSetup, info: dict[str, Any], args: argparse.Namespace,
                 one: BenchRequest, rate_wl: WorkloadConfig | None,
                 results: dict[str, dict[str, LatencyResult]]) -> None:
    report.add(f"Machine: {describe_machine(info)}.\n\nModel {s.model} "
               f"({s.model_folder.name}), {s.dtype_name}, device {s.device}; greedy, EOS "
               f"ignored, the same token-id prompts for both engines.")
    rows = []
    for name, res in results["batch1"].items():
        st = res.stats()
        tokens = len(res.timings[0].token_times) if res.timings else 0
        rows.append([name, one.prompt_len, tokens, len(res.timings), _ms(st["ttft"]["p50"]),
                     _ms(st["tpot"]["p50"]), _ms(st["e2e"]["p50"]),
                     fmt(tokens / st["e2e"]["p50"]) if st["e2e"]["p50"] else "n/a",
                     fmt(res.cpu_share, 2)])
    report.add(f"## Batch 1 ({args.iters} runs after a warm-up; medians)\n\n" + markdown_table(
        ["engine", "prompt tokens", "output tokens", "runs", "TTFT (ms)", "TPOT (ms)",
         "end-to-end (ms)", "output tok/s", "CPU share"], rows)
        + "\n\nCPU share: CPU time the process got / (wall time x threads); well below the "
          "other engine's, other jobs slowed that run.")
    line = goal_line(results["batch1"], args.goal_ratio)
    if line:
        report.add("### Goal (reported, not asserted)\n\n" + line)
    if rate_wl is not None and results["rate"]:
        rows = []
        for name, res in results["rate"].items():
            st = res.stats()
            cells = [name, fmt(res.duration_s), fmt(res.output_tokens / res.duration_s)]
            for key in ("ttft", "tpot", "itl", "e2e"):
                cells.append(" / ".join(_ms(st[key][f"p{q}"]) for q in PERCENTILES))
            rows.append(cells)
        report.add(
            f"## Under a request rate ({args.request_rate} requests/s, Poisson)\n\n"
            f"Workload: {rate_wl.describe()}. vllm_lite: requests join the running batch at "
            f"the next step (max_num_seqs {args.max_num_seqs}); HF generate: static batches of "
            f"whatever has arrived, up to {args.hf_batch_size}, served one after another. "
            "Cells are p50 / p95 / p99 in ms.\n\n"
            + markdown_table(["engine", "duration (s)", "output tok/s", "TTFT", "TPOT",
                              "ITL", "end-to-end"], rows))
    report.data = {
        "machine": info, "model": s.model, "dtype": s.dtype_name, "device": str(s.device),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "batch1": {k: v.to_dict() for k, v in results["batch1"].items()},
        "rate": {k: v.to_dict() for k, v in results["rate"].items()},
        "rate_workload": rate_wl.__dict__ if rate_wl else None,
    }
    report.figure("latency", lambda plt: plot_latency(plt, results), "latency")


def plot_latency(plt: Any, results: dict[str, dict[str, LatencyResult]]) -> None:
    panels = 1 + (2 if results["rate"] else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 3.5), squeeze=False)
    ax = axes[0][0]
    names = list(results["batch1"])
    ttft = [1000 * (results["batch1"][n].stats()["ttft"]["p50"] or 0) for n in names]
    rest = [1000 * ((results["batch1"][n].stats()["e2e"]["p50"] or 0)
                    - (results["batch1"][n].stats()["ttft"]["p50"] or 0)) for n in names]
    ax.bar(names, ttft, label="TTFT", color="tab:blue")
    ax.bar(names, rest, bottom=ttft, label="decode", color="tab:green")
    ax.set_ylabel("batch-1 latency (ms, median)")
    ax.set_ylim(0, 1.3 * max([t + r for t, r in zip(ttft, rest)] + [1.0]))  # room for the legend
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    for j, key in enumerate(("ttft", "tpot"), start=1):
        if j >= panels:
            break
        ax = axes[0][j]
        for name, res in results["rate"].items():
            values = sorted(1000 * v for v in (getattr(t, key) for t in res.timings) if v is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{key.upper()} under the request rate", fontsize=9)
        ax.legend(fontsize=8)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/latency.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli("latency", run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
