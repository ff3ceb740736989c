"""`vllm-lite serve` drains on SIGTERM: it stops accepting connections at once, /health is
503 on the connections it still holds, the requests in flight finish whole (equal to the
offline engine's tokens), and then it exits; past --drain-timeout what is left is cut off
and it exits anyway."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from entrypoints.utils import MODEL_NAME, ServeProcess
from vllm_lite import SamplingParams


def _slow_stream(url: str, prompt: list[int], max_tokens: int, pause: float,
                 result: dict[str, Any], started: threading.Event) -> None:
    """A streamed completion read slowly (``pause`` s per event), so it is still in flight
    when the server is told to stop: its token ids, or the error that ended it."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    ids: list[int] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    result["done"] = result.get("done", False) or line == "data: [DONE]"
                    continue
                chunk = json.loads(line[6:])
                for tok in chunk["choices"][0]["logprobs"]["tokens"]:
                    ids.append(int(tok.removeprefix("token_id:")))
                started.set()
                time.sleep(pause)
    except httpx.HTTPError as e:
        result["error"] = repr(e)
    finally:
        started.set()
        result["ids"] = ids


def _run_streams(srv: ServeProcess, prompts: list[list[int]], max_tokens: int,
                 pause: float) -> tuple[list[dict[str, Any]], list[threading.Thread]]:
    results: list[dict[str, Any]] = [{} for _ in prompts]
    threads = []
    for prompt, result in zip(prompts, results):
        started = threading.Event()
        t = threading.Thread(target=_slow_stream,
                             args=(srv.url, prompt, max_tokens, pause, result, started))
        t.start()
        assert started.wait(60), "a stream did not start"
        threads.append(t)
    return results, threads


def test_sigterm_drains_in_flight_requests(model_dir: Path, tmp_path: Path,
                                           offline: Any) -> None:
    prompts = [[3 + i, 17, 5 * i + 1, 40] for i in range(4)]
    max_tokens = 24
    srv = ServeProcess(model_dir, tmp_path, args=["--drain-timeout", "60",
                                                  "--log-level", "info"]).start()
    try:
        srv.wait_healthy()
        keep = httpx.Client(base_url=srv.url, timeout=10)  # a connection opened before
        assert keep.get("/health").status_code == 200
        # Each stream reads one event per 0.1 s: ~2.4 s in flight, whatever the step time.
        results, threads = _run_streams(srv, prompts, max_tokens, pause=0.1)
        srv.signal(signal.SIGTERM)
        # New connections are refused at once (a load balancer sends them elsewhere) ...
        deadline = time.monotonic() + 5
        while True:
            try:
                httpx.get(srv.url + "/health", timeout=1)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                # Refused; or reset unanswered: a connection still in the listener's
                # backlog when it closed.
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        # ... while the process lives on until the streams are done.
        assert srv.proc.poll() is None
        for t in threads:
            t.join(60)
        rc = srv.wait(30)
    finally:
        rc, log = srv.stop()
    assert rc in (0, -signal.SIGTERM), log
    assert "draining: " in log and "Traceback" not in log, log
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True), use_tqdm=False)
    for result, ref in zip(results, refs):
        assert "error" not in result and result.get("done"), result
        assert result["ids"] == ref.outputs[0].token_ids


def test_drain_timeout_cuts_off_what_is_left(model_dir: Path, tmp_path: Path) -> None:
    # One sequence per step and 24 queued requests of 240 tokens: 5760 steps, seconds of
    # work on any machine, far past the 1 s drain.
    srv = ServeProcess(model_dir, tmp_path, args=["--drain-timeout", "1",
                                                  "--max-num-seqs", "1"]).start()
    statuses: list[Any] = []

    def post(i: int) -> None:
        try:
            r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": [5, 6, i], "max_tokens": 240,
                "ignore_eos": True})
            statuses.append(r.status_code)
        except httpx.HTTPError as e:
            statuses.append(type(e).__name__)

    try:
        srv.wait_healthy()
        threads = [threading.Thread(target=post, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        stopped = time.monotonic()
        srv.signal(signal.SIGTERM)
        srv.wait(30)
        took = time.monotonic() - stopped
        for t in threads:
            t.join(30)
    finally:
        rc, log = srv.stop()
    assert rc in (0, -signal.SIGTERM), log
    assert took < 10, f"exited {took:.1f} s after SIGTERM with --drain-timeout 1"
    # Cut off: the requests still queued or running got no 200 (a 500 or a closed
    # connection), and none hangs.
    assert len(statuses) == 24 and statuses.count(200) < 24, statuses


@pytest.mark.parametrize("flag, value", [("--drain-timeout", "-1"),
                                         ("--batching-delay-ms", "nan")])
def test_bad_drain_and_delay_flags(model_dir: Path, tmp_path: Path, flag: str,
                                   value: str) -> None:
    srv = ServeProcess(model_dir, tmp_path, args=[flag, value]).start()
    rc = srv.wait(120)
    _, log = srv.stop()
    assert rc == 2 and flag.removeprefix("--").replace("-", "_") in log, log
    assert "Traceback" not in log, log
