"""Prometheus metrics of a serving engine, named like vLLM's with a ``vllm_lite:`` prefix.

The KV-pool metrics keep vLLM's ``gpu_*`` names (``gpu_cache_usage_perc``,
``gpu_cache_blocks_total/free``, ``gpu_prefix_cache_hit_rate``) so vLLM dashboards work
unchanged; on a CPU they describe the device pool in CPU memory ("cpu_*" is the swap pool).

Each server owns its ``CollectorRegistry`` (not prometheus-client's global one), so several
servers can live in one process (tests). Everything here is fed by the engine thread:

    metrics.on_request_added(request_id, num_prompt_tokens)     when it enters the engine
    metrics.on_outputs(outputs)                                  after each step
    metrics.on_request_aborted(request_id)                       when it is aborted
    metrics.on_engine_stats(engine.stats())                      after each loop iteration

and read by the HTTP thread with ``render()`` (the text exposition format).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from vllm_lite.core.scheduler import SchedulerStats

PREFIX = "vllm_lite:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. TTFT covers queueing plus prefill; TPOT one decode step; e2e a whole request.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# request_success's finished_reason values: the engine's finish reasons, and the requests
# that left unfinished (aborted by their client, or failed by the engine).
FINISH_REASONS = ("stop", "length", "abort", "error")
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


def _usage(total: int, free: int) -> float:
    return 1.0 - free / total if total else 0.0


@dataclass
class _RequestTimes:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    # Output tokens seen so far, per completion index.
    num_tokens: dict[int, int] = field(default_factory=dict)


class Metrics:
    """The server's metrics; ``model_name`` labels every series, as in vLLM."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        # The *_created series only double the output (a process-wide switch).
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("num_requests_running", "Requests running on the engine.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_swapped = gauge("num_requests_swapped", "Requests swapped out to the CPU pool.")
        self.device_cache_usage = gauge("gpu_cache_usage_perc",
                                     "Fraction of KV cache blocks in use (1 = full).")
        self.cpu_cache_usage = gauge("cpu_cache_usage_perc",
                                     "Fraction of CPU swap blocks in use (1 = full).")
        self.device_blocks_total = gauge("gpu_cache_blocks_total", "KV cache blocks in the pool.")
        self.device_blocks_free = gauge("gpu_cache_blocks_free", "KV cache blocks free.")
        self.cpu_blocks_total = gauge("cpu_cache_blocks_total", "CPU swap blocks in the pool.")
        self.cpu_blocks_free = gauge("cpu_cache_blocks_free", "CPU swap blocks free.")
        self.prefix_hit_rate = gauge("gpu_prefix_cache_hit_rate",
                                     "Prefix cache hits / full prompt blocks looked up.")
        # Counters beside the since-start ratio above: a hit rate over a window, and one
        # summed correctly over replicas, is rate(hits) / rate(queries).
        self.prefix_queries = counter("gpu_prefix_cache_queries",
                                      "Full prompt blocks looked up in the prefix cache.")
        self.prefix_hits = counter("gpu_prefix_cache_hits",
                                   "Full prompt blocks found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Preemptions (recompute and swap).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds",
                              "From arrival to the first output token.", _TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Time per output token after the first (per step, per request).",
                              _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "From arrival to the last output.", _E2E_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Requests finished, by reason.",
                                labels + ["finished_reason"], registry=r)
        # Every reason's series exists from the start (at 0): Prometheus's rate() and
        # increase() would miss a series' first request otherwise.
        for reason in FINISH_REASONS:
            self._success.labels(model_name, reason)
        self._requests: dict[str, _RequestTimes] = {}
        self._last = {"preemptions": 0, "queries": 0, "hits": 0}

    # -- fed by the engine thread ------------------------------------------------------------
    def on_request_added(self, request_id: str, num_prompt_tokens: int,
                         arrival: float | None = None) -> None:
        self._requests[request_id] = _RequestTimes(
            time.monotonic() if arrival is None else arrival, num_prompt_tokens)

    def on_outputs(self, outputs: Iterable[Any], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for out in outputs:
            times = self._requests.get(out.request_id)
            if times is None:
                continue
            new = 0
            for c in out.outputs:
                n = len(c.token_ids)
                new += n - times.num_tokens.get(c.index, 0)
                times.num_tokens[c.index] = n
            if new > 0:
                if times.first_token is None:
                    times.first_token = now
                    self.ttft.observe(now - times.arrival)
                    self.prompt_tokens.inc(times.num_prompt_tokens)
                else:
                    self.tpot.observe(now - times.last_token)
                times.last_token = now
                self.generation_tokens.inc(new)
            if out.finished:
                del self._requests[out.request_id]
                self.e2e.observe(now - times.arrival)
                # One count per request; n > 1 completions are labelled by the first one.
                reason = (out.outputs[0].finish_reason if out.outputs else None) or "length"
                self._success.labels(self.model_name, reason).inc()

    def on_request_aborted(self, request_id: str, reason: str = "abort") -> None:
        """The request left the engine unfinished: "abort", or "error" (a failed step)."""
        if self._requests.pop(request_id, None) is not None:
            self._success.labels(self.model_name, reason).inc()

    def on_engine_stats(self, stats: SchedulerStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.device_cache_usage.set(_usage(stats.device_blocks_total, stats.device_blocks_free))
        self.cpu_cache_usage.set(_usage(stats.cpu_blocks_total, stats.cpu_blocks_free))
        self.device_blocks_total.set(stats.device_blocks_total)
        self.device_blocks_free.set(stats.device_blocks_free)
        self.cpu_blocks_total.set(stats.cpu_blocks_total)
        self.cpu_blocks_free.set(stats.cpu_blocks_free)
        q = stats.prefix_cache_queries
        self.prefix_hit_rate.set(stats.prefix_cache_hits / q if q else 0.0)
        for key, now, counter in (("preemptions", stats.num_preemptions, self.preemptions),
                                  ("queries", stats.prefix_cache_queries, self.prefix_queries),
                                  ("hits", stats.prefix_cache_hits, self.prefix_hits)):
            if now > self._last[key]:
                counter.inc(now - self._last[key])
            self._last[key] = now

    # -- read by the HTTP thread -------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
