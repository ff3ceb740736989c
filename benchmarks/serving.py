#!/usr/bin/env python3
"""Serving benchmark: a request-rate sweep against the OpenAI-compatible server.

For each request rate (requests/s, Poisson arrivals; "inf" sends them all at once) it
sends --num-prompts streaming completions of --input-len prompt tokens and exactly
--output-len output tokens (ignore_eos) and measures, per request, from the client:

  TTFT   time to first token: request sent -> first streamed token
  TPOT   time per output token after the first: (last token - first token) / (tokens - 1)
  E2E    request sent -> last token

and per rate: p50 / p95 / p99 of each, request and output-token throughput. The server's
own view (/metrics: preemptions, KV cache usage) is read after each rate.

Prompts are random words put through the server's /tokenize and cut to exactly
--input-len token ids, so every model gets real, equally long prompts.

Against a running server:      python3 benchmarks/serving.py --base-url http://127.0.0.1:8000
Starting one itself (default): python3 benchmarks/serving.py --model smollm2-135m
The quick mode (about a minute on 2 CPU cores with the default model):
                               python3 benchmarks/serving.py --quick

Writes a markdown table (also printed), a JSON file and a PNG plot to
benchmarks/results/serving_<timestamp>.{md,json,png}.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/serving.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import asyncio
import datetime as _dt
import importlib.util
import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Sequence

log = logging.getLogger("bench.serving")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
QUICK = dict(rates=["0.5", "2", "inf"], num_prompts=8, input_len=32, output_len=16)
FULL = dict(rates=["0.5", "1", "2", "4", "8", "inf"], num_prompts=32, input_len=128,
            output_len=64)
WORDS = ("the of and to in is was for on that with as by at from his her an which they "
         "time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name "
         "president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason "
         "research girl guy moment air teacher force education").split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = math.nan
    tpot: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0
    error: str = ""


@dataclass
class RateResult:
    rate: str
    # The server's --batching-delay-ms (None: a server not started here, its own setting).
    batching_delay_ms: float | None
    num_requests: int
    num_failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft: dict[str, float] = field(default_factory=dict)
    tpot: dict[str, float] = field(default_factory=dict)
    e2e: dict[str, float] = field(default_factory=dict)
    server: dict[str, float] = field(default_factory=dict)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50 / p95 / p99 by linear interpolation between order statistics; NaN when empty."""
    vals = sorted(v for v in values if not math.isnan(v))
    out = {}
    for p in (50, 95, 99):
        if not vals:
            out[f"p{p}"] = math.nan
            continue
        pos = (len(vals) - 1) * p / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{p}"] = vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
    return out


# -- the server --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace,
                 batching_delay_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
           "--max-num-seqs", str(args.max_num_seqs),
           "--batching-delay-ms", str(batching_delay_ms)]
    if args.model is not None:  # else the server's default model
        cmd += ["--model", args.model]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.kv_cache_space is not None:
        cmd += ["--kv-cache-space", str(args.kv_cache_space)]
    log.info("starting: %s", " ".join(cmd))
    # The server imports the vllm_lite this Python would (the installed one, else this
    # checkout), never a checkout that happens to be the working directory.
    spec = importlib.util.find_spec("vllm_lite")
    home = Path(spec.origin).parent.parent if spec is not None and spec.origin else ROOT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(home)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    proc = subprocess.Popen(cmd, env=env, cwd=tempfile.gettempdir())
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def wait_healthy(client: Any, proc: subprocess.Popen[bytes] | None,
                       timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")
        await asyncio.sleep(0.5)


# -- the load ----------------------------------------------------------------------------------
async def make_prompts(client: Any, model: str, n: int, input_len: int,
                       rng: random.Random) -> list[list[int]]:
    prompts = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(input_len * 2))
        r = await client.post("/tokenize", json={"model": model, "prompt": text,
                                                 "add_special_tokens": False})
        r.raise_for_status()
        tokens = r.json()["tokens"]
        if len(tokens) < input_len:
            raise RuntimeError(f"a prompt tokenized to {len(tokens)} < {input_len} tokens")
        prompts.append(tokens[:input_len])
    return prompts


async def one_request(client: Any, model: str, prompt: list[int],
                      output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return RequestResult(False, error=event["error"]["message"])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices"):
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
    except Exception as e:  # noqa: BLE001  (a failed request is counted, not fatal)
        return RequestResult(False, error=repr(e))
    if first is None:
        return RequestResult(False, error="no tokens streamed")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else math.nan
    return RequestResult(True, ttft=first - start, tpot=tpot, e2e=last - start,
                         output_tokens=tokens)


async def run_rate(client: Any, model: str, prompts: list[list[int]], output_len: int,
                   rate: str, rng: random.Random, delay: float | None) -> RateResult:
    lam = math.inf if rate == "inf" else float(rate)
    tasks = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if i and lam != math.inf:
            await asyncio.sleep(rng.expovariate(lam))
        tasks.append(asyncio.ensure_future(one_request(client, model, prompt, output_len)))
    results: list[RequestResult] = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            log.warning("request failed: %s", r.error)
    return RateResult(
        rate=rate, batching_delay_ms=delay, num_requests=len(results), num_failed=len(results) - len(ok),
        duration_s=duration, request_throughput=len(ok) / duration,
        output_throughput=sum(r.output_tokens for r in ok) / duration,
        ttft=percentiles([r.ttft for r in ok]), tpot=percentiles([r.tpot for r in ok]),
        e2e=percentiles([r.e2e for r in ok]))


async def server_metrics(client: Any) -> dict[str, float]:
    """A few of the server's Prometheus series (model_name label dropped)."""
    r = await client.get("/metrics")
    if r.status_code != 200:
        return {}
    wanted = {"vllm_lite:num_preemptions_total": "preemptions",
              "vllm_lite:generation_tokens_total": "generation_tokens",
              "vllm_lite:gpu_cache_blocks_total": "kv_blocks"}
    out = {}
    for line in r.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[wanted[name]] = float(line.rsplit(" ", 1)[1])
    return out


# -- report ------------------------------------------------------------------------------------
def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}" if x >= 0.1 else f"{x * 1000:.1f}"


def markdown(results: list[RateResult], meta: dict[str, Any]) -> str:
    lines = [f"Serving benchmark, {meta['time']}: model `{meta['model']}`, "
             f"{meta['num_prompts']} requests per rate, {meta['input_len']} prompt tokens, "
             f"{meta['output_len']} output tokens each, {meta['host']}.", "",
             "| batching delay (ms) | rate (req/s) | ok / sent | req/s | output tok/s "
             "| TTFT p50 / p95 / p99 (ms) | TPOT p50 / p95 / p99 (ms) | E2E p50 / p99 (s) "
             "| preemptions |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t, p, e = r.ttft, r.tpot, r.e2e
        delay = "server's" if r.batching_delay_ms is None else f"{r.batching_delay_ms:g}"
        lines.append(
            f"| {delay} | {r.rate} | {r.num_requests - r.num_failed} / {r.num_requests} "
            f"| {r.request_throughput:.2f} | {r.output_throughput:.1f} "
            f"| {_ms(t['p50'])} / {_ms(t['p95'])} / {_ms(t['p99'])} "
            f"| {_ms(p['p50'])} / {_ms(p['p95'])} / {_ms(p['p99'])} "
            f"| {e['p50']:.2f} / {e['p99']:.2f} | {r.server.get('preemptions', 0):.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[RateResult], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    # "inf" is drawn one step to the right of the largest finite rate.
    finite = [float(r.rate) for r in results if r.rate != "inf"]
    far = max(finite) * 2 if finite else 1.0

    def x(r: RateResult) -> float:
        return float(r.rate) if r.rate != "inf" else far

    rates = list(dict.fromkeys(r.rate for r in results))
    xs = [far if rate == "inf" else float(rate) for rate in rates]
    groups: dict[float | None, list[RateResult]] = {}
    for r in results:
        groups.setdefault(r.batching_delay_ms, []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (delay, rs) in enumerate(groups.items()):
        name = "" if len(groups) == 1 else f"delay {delay:g} ms " if delay is not None else ""
        # One delay: every percentile; several: p50 and p99 per delay, one colour each.
        pcts = ("p50", "p95", "p99") if len(groups) == 1 else ("p50", "p99")
        for ax, key in ((axes[0], "ttft"), (axes[1], "tpot")):
            for j, p in enumerate(pcts):
                style = dict(color=f"C{j}") if len(groups) == 1 else \
                    dict(color=f"C{i}", linestyle="-" if p == "p50" else "--")
                ax.plot([x(r) for r in rs], [getattr(r, key)[p] * 1000 for r in rs],
                        marker="o", label=f"{name}{p}", **style)
        axes[2].plot([x(r) for r in rs], [r.output_throughput for r in rs], marker="o",
                     color="C3" if len(groups) == 1 else f"C{i}", label=name or None)
    axes[0].set_ylabel("TTFT (ms)")
    axes[1].set_ylabel("TPOT (ms)")
    axes[2].set_ylabel("output tokens/s")
    labels = rates
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(xs, labels)
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    if len(groups) > 1:
        axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main ----------------------------------------------------------------------------------------
async def bench(args: argparse.Namespace, base_url: str, proc: subprocess.Popen[bytes] | None,
                delay: float | None) -> tuple[list[RateResult], str]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.num_prompts + 8)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=args.request_timeout) as client:
        await wait_healthy(client, proc, args.startup_timeout)
        models = (await client.get("/v1/models")).json()["data"]
        model = models[0]["id"]
        rng = random.Random(args.seed)
        prompts = await make_prompts(client, model, args.num_prompts, args.input_len, rng)
        # Warm up (first-call costs: allocations, lazy imports) before timing.
        await one_request(client, model, prompts[0], 2)
        results = []
        for rate in args.rates:
            before = await server_metrics(client)
            log.info("rate %s, batching delay %s ms: %d requests", rate, delay, len(prompts))
            res = await run_rate(client, model, prompts, args.output_len, rate, rng, delay)
            after = await server_metrics(client)
            res.server = {k: after[k] - before.get(k, 0.0) for k in after
                          if k != "kv_blocks"}
            results.append(res)
            log.info("rate %s: %.2f req/s, %.1f tok/s, TTFT p50 %.0f ms", rate,
                     res.request_throughput, res.output_throughput, res.ttft["p50"] * 1000)
        return results, model


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None,
                   help="a running server (default: start one with --model)")
    p.add_argument("--model", default=None,
                   help="model for the server started here (default: vllm-lite serve's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the server started here (default: torch's)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_LITE_API_KEY"))
    p.add_argument("--quick", action="store_true",
                   help=f"few rates and short requests (about a minute): {QUICK}")
    p.add_argument("--rates", nargs="+", default=None, help=f"req/s or inf (default {FULL['rates']})")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64, help="for the server started here")
    p.add_argument("--batching-delay-ms", type=float, nargs="+", default=None, metavar="D",
                   help="one server started here per value, each swept over every rate "
                        "(default: 0, the server's default; e.g. 0 5 20)")
    p.add_argument("--kv-cache-space", type=float, default=None,
                   help="GiB of KV cache for the server started here (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for rate in args.rates:
        if rate != "inf" and not (_is_float(rate) and float(rate) > 0):
            p.error(f"--rates takes positive numbers or inf, got {rate!r}")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batching_delay_ms is not None:
        if args.base_url is not None:
            p.error("--batching-delay-ms applies to the server started here, not to "
                    "--base-url (set it on that server)")
        bad = [d for d in args.batching_delay_ms if not 0 <= d < math.inf]
        if bad:
            p.error(f"--batching-delay-ms takes finite numbers >= 0, got {bad[0]}")
    return args


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    args = parse_args(argv)
    proc = None
    results: list[RateResult] = []
    if args.base_url is not None:
        base_url = args.base_url
        results, model = asyncio.run(bench(args, base_url.rstrip("/"), None, None))
    # One fresh server per batching delay, so no run inherits another's warm state.
    for delay in args.batching_delay_ms or ([0.0] if args.base_url is None else []):
        proc, base_url = start_server(args, delay)
        try:
            res, model = asyncio.run(bench(args, base_url.rstrip("/"), proc, delay))
            results += res
        finally:
            stop_server(proc)
    stamp = _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    meta = dict(time=stamp, model=model, num_prompts=args.num_prompts, input_len=args.input_len,
                output_len=args.output_len, base_url=base_url,
                host=f"{os.cpu_count()} CPUs" + (" (server started here)" if proc else ""))
    table = markdown(results, meta)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"serving_{stamp}"
    stem.with_suffix(".md").write_text(table)
    stem.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "results": [asdict(r) for r in results]}, indent=1))
    if plot(results, stem.with_suffix(".png"), f"vllm_lite serving: {model}"):
        log.info("wrote %s.{md,json,png}", stem)
    failed = sum(r.num_failed for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
