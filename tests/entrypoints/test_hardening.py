"""Hardening: what an attacker tried against `vllm-lite serve`, each item
reproduced against a real uvicorn server on loopback. After each, the server still
answers correctly and /metrics shows no running request and every KV block free."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import httpx
import pytest
import torch

from entrypoints.utils import (MODEL_NAME, ServerThread, make_llm, read_metrics,  # noqa: E402
                              stream_ids, token_ids)
import vllm_lite  # noqa: E402
from vllm_lite import SamplingParams  # noqa: E402
from vllm_lite.entrypoints.openai.api_server import (  # noqa: E402
    ServerConfig, default_served_name)

TIMEOUT = 60
POISON_SEED = 4242  # a legal seed; the poisoned sampler below fails the rows that carry it


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _wait_idle(url: str, timeout: float = 15.0) -> dict[str, float]:
    """Waits until no request is in the engine and every block is free; returns /metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
        idle = (m["vllm_lite:num_requests_running"] == m["vllm_lite:num_requests_waiting"]
                == m["vllm_lite:num_requests_swapped"] == 0
                and m["vllm_lite:gpu_cache_blocks_free"] == m["vllm_lite:gpu_cache_blocks_total"])
        if idle:
            return m
        assert time.monotonic() < deadline, f"the server did not come back to idle: {m}"
        time.sleep(0.05)


def _still_serves(url: str, offline: Any) -> None:
    """A fresh greedy request gets exactly the offline tokens; nothing is left running."""
    prompt = _prompt(7, seed=int(time.monotonic_ns() % 1000))
    r = httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=5,
                                                     ignore_eos=True), use_tqdm=False)
    assert token_ids(r.json()["choices"][0]["logprobs"]["tokens"]) == want[0].outputs[0].token_ids
    _wait_idle(url)


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    return err


# -- a request that breaks the shared step fails alone ---------------------------------------------
class _PoisonedSampler:
    """The engine's sampler, failing every batch that holds a row seeded POISON_SEED, the
    way seed=2**64 once failed inside the batched generator setup."""

    def __init__(self, sampler: Any) -> None:
        self.inner = sampler
        self.failures = 0
        self.shared_failures = 0  # failing batches that also held other requests' rows
        self.pace_s = 0.0  # a sleep per call, so victims are still running when poison comes

    def __call__(self, logits: torch.Tensor, metadata: Any) -> Any:
        if self.pace_s:
            time.sleep(self.pace_s)
        if any(r.params.seed == POISON_SEED for r in metadata.rows):
            self.failures += 1
            if any(r.params.seed != POISON_SEED for r in metadata.rows):
                self.shared_failures += 1
            raise ValueError("Overflow when unpacking long long")
        return self.inner(logits, metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def poisoned(model_dir: Path) -> Iterator[dict[str, Any]]:
    llm = make_llm(model_dir)
    sampler = _PoisonedSampler(llm.llm_engine.runner.sampler)
    llm.llm_engine.runner.sampler = sampler
    with ServerThread(llm) as srv:
        yield {"server": srv, "sampler": sampler}


VICTIMS = 8


def _victims() -> list[dict[str, Any]]:
    bodies = []
    for i in range(VICTIMS):
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": _prompt(5 + 3 * i, seed=100 + i),
                                "max_tokens": 40, "ignore_eos": True, "stream": True,
                                "logprobs": 0, "return_tokens_as_token_ids": True}
        # Half greedy, half seeded sampling: both must come out exactly as offline.
        body.update({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": 7 + i})
        bodies.append(body)
    return bodies


POISONS = [
    # A legal request that still breaks the shared sampler: a 500 for it alone. First, so
    # that it arrives while every victim runs.
    ({"seed": POISON_SEED, "temperature": 1.0}, 500, None),
    # Values that once passed validation and broke the step: now a 400 naming the field.
    ({"seed": 2 ** 64, "temperature": 1.0}, 400, "seed"),
    ({"seed": -(2 ** 63) - 1, "temperature": 1.0}, 400, "seed"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0, "length_penalty": 1e308}, 400,
     "length_penalty"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0, "length_penalty": -1e308}, 400,
     "length_penalty"),
    ({"temperature": 1e308 * 10}, 400, "temperature"),  # inf (JSON Infinity)
    # top_k past the vocabulary means "all tokens" (clamped, as vLLM): it runs.
    ({"top_k": 2 ** 63, "temperature": 1.0, "seed": 3}, 200, None),
]


def test_poison_requests_never_fail_the_others(poisoned: dict[str, Any], offline: Any) -> None:
    srv = poisoned["server"]
    victims = _victims()
    want = []
    for body in victims:
        params = SamplingParams(temperature=body["temperature"], seed=body.get("seed"),
                                max_tokens=body["max_tokens"], ignore_eos=True)
        want.append(offline.generate([body["prompt"]], params, use_tqdm=False)[0]
                    .outputs[0].token_ids)
    sampler = poisoned["sampler"]
    shared_before = sampler.shared_failures
    # >= 0.4 s per victim (40 sampling steps): the second round of poison (0.35 s in)
    # still meets them.
    sampler.pace_s = 0.01

    async def run() -> tuple:
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT) as client:
            tasks = [asyncio.ensure_future(stream_ids(client, b)) for b in victims]
            answers = []
            # Poison while the victims stream, one every 50 ms, each kind twice.
            for extra, _, _ in POISONS * 2:
                body = {"model": MODEL_NAME, "prompt": _prompt(6, seed=1), "max_tokens": 20,
                        "ignore_eos": True}
                body.update(extra)
                content = json.dumps(body, allow_nan=True)  # inf as Infinity
                answers.append(asyncio.ensure_future(client.post(
                    "/v1/completions", content=content,
                    headers={"content-type": "application/json"})))
                await asyncio.sleep(0.05)
            return await asyncio.gather(*tasks), await asyncio.gather(*answers)

    try:
        got, answers = asyncio.run(run())
    finally:
        sampler.pace_s = 0.0
    for body, tokens, expected in zip(victims, got, want):
        assert tokens[0] == expected, body  # n=1: completion index 0
    for (extra, status, param), r in zip(POISONS * 2, answers):
        err = None if status == 200 else _error(r, status, param)
        if status == 200:
            assert r.status_code == 200, r.text
        if status == 500:
            assert "Overflow" in err["message"]
    # The poisoned rows really broke shared steps: batches that held victims' rows too.
    assert sampler.shared_failures > shared_before
    m = _wait_idle(srv.url)
    assert m['vllm_lite:request_success_total{finished_reason="error"}'] >= 2


def test_offline_generate_keeps_the_valid_prompts(model_dir: Path) -> None:
    """LLM.generate with a poisoned prompt among valid ones returns every valid output (as
    if alone) and an error output for the poisoned one; every block is freed."""
    llm = make_llm(model_dir)
    ref = make_llm(model_dir)
    llm.llm_engine.runner.sampler = _PoisonedSampler(llm.llm_engine.runner.sampler)
    prompts = [_prompt(4 + i, seed=200 + i) for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=12, n=2, max_tokens=9, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].error is not None and "Overflow" in outs[2].error
    assert outs[2].finished
    for i in (0, 1, 3, 4):
        assert outs[i].error is None
        want = ref.generate([prompts[i]], params[i], use_tqdm=False)[0]
        assert [c.token_ids for c in outs[i].outputs] == [c.token_ids for c in want.outputs]
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_total_device_blocks


# -- big bodies, long prompts, the event loop -----------------------------------------------------
@pytest.fixture(scope="module")
def small_limits(model_dir: Path) -> Iterator[ServerThread]:
    config = ServerConfig(served_model_name=MODEL_NAME, max_request_bytes=64 * 1024,
                          max_prompts_per_request=8, max_chat_messages=6, max_connections=6,
                          read_timeout_s=3.0, keep_alive_timeout_s=1.0)
    # A small pool (1,040 tokens) for the n x max_tokens check.
    with ServerThread(make_llm(model_dir, num_gpu_blocks_override=260), config) as srv:
        yield srv


def test_body_over_the_limit_is_413_before_it_is_read(small_limits: ServerThread,
                                                      offline: Any) -> None:
    url = small_limits.url
    big = {"model": MODEL_NAME, "prompt": "a" * (70 * 1024), "max_tokens": 2}
    _error(httpx.post(url + "/v1/completions", json=big, timeout=TIMEOUT), 413)
    _error(httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "b" * 70_000}]}), 413)

    # A client that announces 48 MB gets its 413 without sending them.
    with socket.create_connection(("127.0.0.1", small_limits.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 50000000\r\n\r\n{\"prompt\": \"")
        head = s.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413"), head

    # A chunked body (no length announced) is cut off once it passes the limit.
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "'
        for _ in range(100):
            yield b"c" * 4096
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunks(), timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    _error(r, 413)
    _still_serves(url, offline)


def test_prompt_longer_than_any_context_is_refused_before_tokenizing(
        small_limits: ServerThread, offline: Any) -> None:
    url = small_limits.url
    serving = small_limits.app.state  # noqa: F841  (the app is live)
    # Under the byte limit, over what max_model_len tokens could ever hold.
    text = "hello world " * 5000
    err = _error(httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "prompt": text, "max_tokens": 2}), 400, "prompt")
    assert "characters" in err["message"]
    _error(httpx.post(url + "/tokenize", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "prompt": text}), 400, "prompt")
    _error(httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": text}]}), 400, "messages")
    _still_serves(url, offline)


def test_tokenization_runs_off_the_event_loop(model_dir: Path, offline: Any) -> None:
    """While one request's tokenization takes seconds, /health answers at once and other
    requests are served."""
    llm = make_llm(model_dir)
    with ServerThread(llm) as srv:
        tok = llm.get_tokenizer()
        release = threading.Event()
        entered = threading.Event()
        real_encode = type(tok).encode

        def slow_encode(self: Any, text: Any, *a: Any, **kw: Any) -> Any:
            if isinstance(text, str) and text.startswith("SLOW"):
                entered.set()
                release.wait(10)  # a tokenizer busy with a huge prompt
            return real_encode(self, text, *a, **kw)

        type(tok).encode = slow_encode
        try:
            slow = threading.Thread(target=lambda: httpx.post(
                srv.url + "/v1/completions", timeout=TIMEOUT,
                json={"model": MODEL_NAME, "prompt": "SLOW hello", "max_tokens": 2}))
            slow.start()
            assert entered.wait(10)
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - t0 < 1.0
            r = httpx.post(srv.url + "/v1/completions", timeout=TIMEOUT, json={
                "model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2})
            assert r.status_code == 200, r.text
            release.set()
            slow.join(30)
        finally:
            release.set()
            type(tok).encode = real_encode
        _still_serves(srv.url, offline)


# -- caps per request --------------------------------------------------------------------------------
def test_caps_per_request(small_limits: ServerThread, offline: Any) -> None:
    url = small_limits.url
    err = _error(httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "prompt": [[1, 2]] * 9, "max_tokens": 2}), 400, "prompt")
    assert "at most 8" in err["message"]
    r = httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "prompt": [[1, 2]] * 8, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    msgs = [{"role": "user", "content": "hi"}] * 7
    _error(httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "messages": msgs}), 400, "messages")

    # n x (prompt + max_tokens) that can never be in the cache at once: 400, not a 200
    # with truncated choices.
    engine = small_limits.engine.engine
    usable = engine.scheduler.usable_device_blocks() * engine.cache_config.block_size
    n = 16
    max_tokens = min(200, usable // n + 40)
    assert n * max_tokens > usable
    body = {"model": MODEL_NAME, "prompt": _prompt(8, seed=3), "n": n, "temperature": 1.0,
            "max_tokens": max_tokens, "ignore_eos": True}
    err = _error(httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT), 400)
    assert "KV blocks" in err["message"]
    # What fits runs to the end: every choice gets all its tokens.
    body["max_tokens"] = max(1, usable // n // 2)
    r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
    assert r.json()["usage"]["completion_tokens"] == n * body["max_tokens"]
    _still_serves(url, offline)


# -- connections -----------------------------------------------------------------------------------
def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_slow_and_idle_connections_are_closed(small_limits: ServerThread, offline: Any) -> None:
    port = small_limits.port
    # Headers sent a byte at a time, slower than the 3 s read timeout allows.
    slow = socket.create_connection(("127.0.0.1", port))
    start = time.monotonic()
    closed = False
    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
        try:
            slow.sendall(bytes([byte]))
        except OSError:
            closed = True
            break
        if _closed_within(slow, 0.25):
            closed = True
            break
    assert closed and time.monotonic() - start < 8
    slow.close()
    # A connection that sends nothing is closed too.
    idle = socket.create_connection(("127.0.0.1", port))
    assert _closed_within(idle, 8)
    idle.close()
    # Keep-alive: idle after a response, closed after keep_alive_timeout_s.
    ka = socket.create_connection(("127.0.0.1", port))
    ka.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ka.recv(4096).startswith(b"HTTP/1.1 200")
    assert _closed_within(ka, 5)
    ka.close()
    _still_serves(small_limits.url, offline)


def test_connection_cap_keeps_health_answering(small_limits: ServerThread,
                                               offline: Any) -> None:
    url, port = small_limits.url, small_limits.port
    hogs = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    try:
        time.sleep(0.2)
        with httpx.Client(timeout=TIMEOUT) as c:
            assert c.get(url + "/health").status_code == 200  # past the cap: /health only
        with httpx.Client(timeout=TIMEOUT) as c:
            _error(c.get(url + "/v1/models"), 503)
    finally:
        for s in hogs:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(url + "/v1/models", timeout=TIMEOUT).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _still_serves(url, offline)


_FLOOD_SERVER = textwrap.dedent("""
    import logging, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
    sys.path.insert(0, sys.argv[2])
    from entrypoints.utils import make_llm
    from vllm_lite.entrypoints.openai.api_server import ServerConfig, serve
    logging.basicConfig(level=logging.INFO)
    llm = make_llm(sys.argv[1])
    serve(llm.llm_engine, ServerConfig(port=int(sys.argv[3]), served_model_name="tiny-llama",
                                       read_timeout_s=2.0))
""")


def test_descriptor_exhaustion_does_not_flood_the_log(model_dir: Path, tmp_path: Path) -> None:
    """With a tiny open-file limit, a flood of connections gets refused past the cap, the
    log stays small, and /health answers once the flood is gone."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "server.log"
    tests_dir = str(Path(__file__).resolve().parent.parent)
    # Run outside the checkout: `python -c` puts the cwd first on sys.path, and the checkout's
    # vllm_lite has no built extension when the package is installed (as in CI).
    home = str(Path(vllm_lite.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([home] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p])}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _FLOOD_SERVER, str(model_dir), tests_dir,
                                 str(port)], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        socks = []
        for _ in range(400):  # twice the process's descriptor limit
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        time.sleep(3)
        for s in socks:
            s.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=TIMEOUT,
                       json={"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "connection limit" in text  # the flood did reach the cap
    # The accept errors were there (the descriptor table did fill) but rate-limited to a
    # few lines.
    assert 1 <= text.count("out of system resource") <= 12, text[-3000:]
    assert len(text) < 100_000, text[-3000:]


# -- logprobs of cut tokens ------------------------------------------------------------------------
def test_logprobs_of_cut_tokens_are_finite(server: ServerThread, offline: Any) -> None:
    url = server.url
    base = {"model": MODEL_NAME, "prompt": _prompt(6, seed=9), "max_tokens": 4, "top_k": 2,
            "temperature": 1.0, "seed": 5, "logprobs": 5}
    r = httpx.post(url + "/v1/completions", json=base, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    values = [v for t in tops for v in t.values()]
    assert -9999.0 in values and all(math.isfinite(v) for v in values)
    # Streamed: the same numbers, no nulls.
    with httpx.stream("POST", url + "/v1/completions", json={**base, "stream": True},
                      timeout=TIMEOUT) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    streamed = [v for e in events for t in e["choices"][0]["logprobs"]["top_logprobs"]
                for v in t.values()]
    assert None not in streamed and sorted(streamed) == sorted(values)
    # Echo with prompt logprobs, and chat.
    r = httpx.post(url + "/v1/completions", json={**base, "echo": True}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3, "top_k": 2, "temperature": 1.0, "seed": 1, "logprobs": True,
        "top_logprobs": 5})
    assert r.status_code == 200, r.text
    chat_values = [t["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"]
                   for t in c["top_logprobs"]]
    assert -9999.0 in chat_values
    # And offline: LLM outputs carry the same floor.
    out = offline.generate([base["prompt"]], SamplingParams(top_k=2, temperature=1.0, seed=5,
                                                            max_tokens=4, logprobs=5,
                                                            prompt_logprobs=5),
                           use_tqdm=False)[0]
    lps = [lp.logprob for d in out.outputs[0].logprobs for lp in d.values()]
    lps += [lp.logprob for d in out.prompt_logprobs if d for lp in d.values()]
    assert -9999.0 in lps and all(math.isfinite(v) for v in lps)
    _wait_idle(url)


# -- a client that stops reading --------------------------------------------------------------------
def _assert_drained(llm: Any) -> None:
    """Within 10 s the engine holds no request and every KV block is free."""
    deadline = time.monotonic() + 10
    while llm.llm_engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_total_device_blocks


def test_stream_that_is_never_read_is_aborted(model_dir: Path) -> None:
    """A consumer that takes one output and then reads nothing: its request is aborted
    after stream_timeout and its blocks freed; meanwhile it holds one output, not a queue."""
    from vllm_lite.engine.async_engine import AsyncLLMEngine

    llm = make_llm(model_dir)
    engine = AsyncLLMEngine(llm.llm_engine, stream_timeout=0.5)
    # Paced (>= 5 s for 250 tokens) so the request cannot finish before it is aborted.
    engine.step_callbacks.append(lambda outs: time.sleep(0.02))
    engine.start()
    try:
        async def run() -> Any:
            gen = engine.generate("stuck", prompt_token_ids=[1, 2, 3],
                                  sampling_params=SamplingParams(max_tokens=250,
                                                                 ignore_eos=True))
            first = await gen.__anext__()
            stream = engine._streams["stuck"]
            await asyncio.sleep(2.0)  # read nothing
            with stream._lock:
                pending = stream._latest
            with pytest.raises(Exception, match="stopped reading"):
                while True:
                    await gen.__anext__()
            await gen.aclose()
            return first, pending

        first, pending = asyncio.run(run())
        assert len(first.outputs[0].token_ids) < 250
        # One cumulative output waited, holding everything generated so far.
        assert pending is not None
        assert len(pending.outputs[0].token_ids) > len(first.outputs[0].token_ids)
        _assert_drained(llm)
    finally:
        engine.shutdown()


def test_multi_prompt_stream_that_is_never_read_is_aborted(model_dir: Path) -> None:
    """A streamed request with several prompts is several engine streams merged into one
    (serving_engine.merge): a consumer that stops reading it must still leave the engine's
    outputs unread, so every one of its requests is aborted after stream_timeout, instead of
    the merge draining the engine into a queue for as long as they run."""
    from vllm_lite.engine.async_engine import AsyncLLMEngine
    from vllm_lite.entrypoints.openai.serving_engine import merge

    llm = make_llm(model_dir)
    engine = AsyncLLMEngine(llm.llm_engine, stream_timeout=0.5)
    engine.step_callbacks.append(lambda outs: time.sleep(0.02))  # >= 5 s for 250 tokens
    engine.start()
    try:
        async def run() -> tuple[int, int]:
            gens = [engine.generate(f"multi-{i}", prompt_token_ids=[1, 2, 3 + i],
                                    sampling_params=SamplingParams(max_tokens=250,
                                                                   ignore_eos=True))
                    for i in range(3)]
            merged = merge(gens)
            _, first = await merged.__anext__()
            await asyncio.sleep(2.5)  # read nothing
            # Unread for 2.5 s: the engine dropped every request of the stream by now.
            left = len(llm.llm_engine.unfinished_request_ids())
            await merged.aclose()
            return left, len(first.outputs[0].token_ids)

        left, first_len = asyncio.run(run())
        assert first_len < 250
        assert left == 0
        _assert_drained(llm)
    finally:
        engine.shutdown()


# -- low ---------------------------------------------------------------------------------------------
def test_priority_needs_the_priority_policy(server: ServerThread, offline: Any) -> None:
    err = _error(httpx.post(server.url + "/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL_NAME, "prompt": [1, 2], "max_tokens": 2, "priority": 3}), 400, "priority")
    assert "priority" in err["message"]
    with pytest.raises(ValueError, match="priority"):
        offline.llm_engine.add_request("p", prompt_token_ids=[1, 2], priority=1)
    _still_serves(server.url, offline)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"model": "tiny-llama", "prompt": "ab\\ud800cd", "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny-llama", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny-llama", "prompt": [1, 2], "stop": ["\\ud834"], '
                        '"max_tokens": 2}'),
    ("/v1/chat/completions", '{"model": "tiny-llama", "messages": [{"role": "user", '
                             '"content": "x\\ud800"}]}'),
    ("/tokenize", '{"model": "tiny-llama", "prompt": "\\ud800"}'),
    ("/tokenize", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\udc00"}]}'),
])
def test_lone_surrogates_are_400(server: ServerThread, path: str, body: str) -> None:
    r = httpx.post(server.url + path, content=body, timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    err = _error(r, 400)
    assert "Unicode" in err["message"]
    _wait_idle(server.url)


def test_auth_scheme_case_and_key_whitespace(model_dir: Path, offline: Any) -> None:
    with pytest.raises(ValueError, match="whitespace"):
        ServerConfig(api_key=" secret")
    with pytest.raises(ValueError, match="whitespace"):
        ServerConfig(api_key="secret\n")
    config = ServerConfig(served_model_name=MODEL_NAME, api_key="s3cret")
    with ServerThread(make_llm(model_dir), config) as srv:
        for header in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "BeArEr  s3cret"):
            r = httpx.get(srv.url + "/v1/models", headers={"Authorization": header},
                          timeout=TIMEOUT)
            assert r.status_code == 200, header
        for header in ("Basic s3cret", "Bearer s3cre", "s3cret", "Bearer"):
            r = httpx.get(srv.url + "/v1/models", headers={"Authorization": header},
                          timeout=TIMEOUT)
            _error(r, 401)
        assert httpx.head(srv.url + "/health", timeout=TIMEOUT).status_code == 200


def test_models_never_show_a_local_path(model_dir: Path) -> None:
    assert default_served_name(str(model_dir)) == model_dir.name
    assert default_served_name("smollm2-135m") == "smollm2-135m"
    assert default_served_name("/models/x/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
    llm = make_llm(model_dir)
    with ServerThread(llm, ServerConfig()) as srv:  # no served name given
        card = httpx.get(srv.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
    assert card["id"] == model_dir.name and card["root"] == model_dir.name
    assert str(model_dir) not in json.dumps(card)


def test_allowed_hosts(model_dir: Path) -> None:
    config = ServerConfig(served_model_name=MODEL_NAME, allowed_hosts=["127.0.0.1", "localhost"])
    with ServerThread(make_llm(model_dir), config) as srv:
        assert httpx.get(srv.url + "/health", timeout=TIMEOUT).status_code == 200
        r = httpx.get(srv.url + "/v1/models", headers={"Host": "evil.example"}, timeout=TIMEOUT)
        _error(r, 400)
        r = httpx.get(srv.url + "/v1/models", headers={"Host": f"localhost:{srv.port}"},
                      timeout=TIMEOUT)
        assert r.status_code == 200


def test_streaming_client_that_stops_reading_is_aborted(model_dir: Path, offline: Any) -> None:
    """A raw client with a tiny receive buffer asks for a long n=16 stream and reads
    nothing: once the socket buffers are full the request is aborted after the stream
    timeout (not run to its end) and its blocks are freed; the server serves on."""
    config = ServerConfig(served_model_name=MODEL_NAME, stream_timeout_s=1.0)
    with ServerThread(make_llm(model_dir), config) as srv:
        # Paced (>= 4.8 s for 240 tokens) so the request cannot run to its end before the
        # buffers fill and the stream timeout passes: unpaced, a fast machine finishes all
        # 240 steps inside the timeout and the request ends as "length" (a CI failure).
        srv.engine.step_callbacks.append(lambda outs: time.sleep(0.02))
        body = json.dumps({"model": MODEL_NAME, "prompt": [1, 2, 3], "n": 16,
                           "temperature": 1.0, "seed": 1, "max_tokens": 240,
                           "ignore_eos": True, "stream": True, "logprobs": 5}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        # Small kernel buffers on the server's side too, so a few steps of events fill
        # everything between the engine and this client (loopback buffers grow to MBs).
        deadline = time.monotonic() + 10
        while not srv.server.server_state.connections:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for conn in list(srv.server.server_state.connections):
            conn.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            deadline = time.monotonic() + 20
            while read_metrics(httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text)[
                    "vllm_lite:num_requests_running"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            m = _wait_idle(srv.url, timeout=30)
        finally:
            s.close()
        assert m['vllm_lite:request_success_total{finished_reason="abort"}'] == 1
        assert m["vllm_lite:generation_tokens_total"] < 16 * 240
        _still_serves(srv.url, offline)
