"""The shipped vllm-router launcher (deploy/vllm-router/run.sh: vllm-router from PyPI, its
cache_aware policy) in front of two real `vllm-lite serve` replicas on loopback (prefix
caching on, an API key that the router passes through):

- completions and chat, streamed and not, through the router with the openai client: the
  same tokens (logprobs, return_tokens_as_token_ids), text and usage as the same request
  sent to a replica directly; a stream ends with data: [DONE]; a wrong key gets the
  replica's 401;
- prefix affinity, read from each replica's /metrics (request_success_total,
  prompt_tokens_total, gpu_prefix_cache_hits_total / _queries_total and
  gpu_prefix_cache_hit_rate): prompts with distinct prefixes sent together land on both
  replicas; each later prompt sharing one of those prefixes goes to one replica, always
  the same for a prefix, the one that holds the prefix in its KV cache (most of its blocks
  are prefix-cache hits, and the hit rate rises), and both replicas keep getting such
  requests; chat requests sharing a system prompt likewise;
- run.sh's argument checks (these need no vllm-router).

The router tests skip where vllm-router is missing (`pip install vllm-router`)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from entrypoints.utils import (MODEL_NAME, ServeProcess, free_port, read_metrics,  # noqa: E402
                               token_ids)

RUN_SH = Path(__file__).resolve().parents[2] / "deploy" / "vllm-router" / "run.sh"
ROUTER = shutil.which("vllm-router")
API_KEY = "router-test-key"
# Startup (two replicas, the router) and every request share this budget.
BUDGET_S = 90.0
REQUEST_TIMEOUT_S = 20.0
# run.sh's tunables: the test clears them from its environment, so what runs is the
# shipped defaults (plus the ports it sets).
RUN_SH_VARS = set(re.findall(r"\$\{([A-Z_]+):-", RUN_SH.read_text()))
SUCCESS = "vllm_lite:request_success_total"
PROMPT_TOKENS = "vllm_lite:prompt_tokens_total"
HIT_RATE = "vllm_lite:gpu_prefix_cache_hit_rate"
HITS = "vllm_lite:gpu_prefix_cache_hits_total"
QUERIES = "vllm_lite:gpu_prefix_cache_queries_total"


@dataclass
class Routed:
    """Two replicas behind the router; ``deadline`` bounds the whole module."""

    folder: Path
    deadline: float
    replicas: list[ServeProcess] = field(default_factory=list)
    router: subprocess.Popen | None = None
    url: str = ""
    log_path: Path | None = None

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        assert left > 0, f"past the {BUDGET_S:.0f} s budget"
        return left

    def client(self, base: str | None = None, api_key: str = API_KEY) -> Any:
        return openai.OpenAI(base_url=(base or self.url) + "/v1", api_key=api_key,
                             max_retries=0, timeout=min(REQUEST_TIMEOUT_S, self.remaining()))

    def metrics(self) -> list[dict[str, float]]:
        return [read_metrics(httpx.get(r.url + "/metrics", timeout=10, headers={
            "Authorization": f"Bearer {API_KEY}"}).text) for r in self.replicas]

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def start(self, model_dir: Path) -> Routed:
        self.replicas = [ServeProcess(model_dir, self.folder, args=[
            "--enable-prefix-caching", "--api-key", API_KEY, "--drain-timeout", "5"])
            for _ in range(2)]
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            r.wait_healthy(timeout=self.remaining())
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in RUN_SH_VARS}
        env.update(ROUTER_HOST="127.0.0.1", ROUTER_PORT=str(port),
                   ROUTER_METRICS_PORT=str(free_port()), VLLM_ROUTER=str(ROUTER))
        self.log_path = self.folder / "router.log"
        with open(self.log_path, "w") as log:
            self.router = subprocess.Popen(["bash", str(RUN_SH), *(r.url for r in self.replicas)],
                                           env=env, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        # The router serves once one replica answers /health; wait for both.
        while True:
            assert self.router.poll() is None, self.log()
            try:
                ready = httpx.get(self.url + "/readiness", timeout=2)
                if ready.status_code == 200 and ready.json().get("healthy_workers") == 2:
                    return self
            except httpx.TransportError:
                pass
            assert self.remaining() > 0, self.log()
            time.sleep(0.1)

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        logs = [r.stop(timeout=15)[1] for r in self.replicas]
        for log in logs:
            assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def routed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    if ROUTER is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    r = Routed(tmp_path_factory.mktemp("vllm_router"), time.monotonic() + BUDGET_S)
    try:
        yield r.start(model_dir)
    finally:
        r.stop()


# -- answers ----------------------------------------------------------------------------------
def _completion(client: Any, stream: bool) -> tuple[list[int], str, str | None, int]:
    """(token ids, text, finish reason, prompt tokens) of one greedy completion."""
    kw: dict[str, Any] = dict(model=MODEL_NAME, prompt="Through the router and back", max_tokens=8,
                              temperature=0, logprobs=1,
                              extra_body={"return_tokens_as_token_ids": True})
    if not stream:
        r = client.completions.create(**kw)
        c = r.choices[0]
        return token_ids(c.logprobs.tokens), c.text, c.finish_reason, r.usage.prompt_tokens
    ids: list[int] = []
    text, finish, prompt_tokens = "", None, -1
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                ids += token_ids(c.logprobs.tokens)
            text += c.text
            finish = c.finish_reason or finish
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    return ids, text, finish, prompt_tokens


def _chat(client: Any, stream: bool) -> tuple[list[int], str, str | None, int]:
    kw: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=8, temperature=0, logprobs=True,
                              messages=[{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Route me"}],
                              extra_body={"return_tokens_as_token_ids": True})
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        return (token_ids([t.token for t in c.logprobs.content]), c.message.content,
                c.finish_reason, r.usage.prompt_tokens)
    ids: list[int] = []
    text, finish, prompt_tokens = "", None, -1
    for chunk in client.chat.completions.create(stream=True, stream_options={
            "include_usage": True}, **kw):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                ids += token_ids([t.token for t in c.logprobs.content])
            text += c.delta.content or ""
            finish = c.finish_reason or finish
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    return ids, text, finish, prompt_tokens


@pytest.mark.parametrize("kind", [_completion, _chat], ids=["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_answers_equal_a_replicas(routed: Routed, kind: Any, stream: bool) -> None:
    via_router = kind(routed.client(), stream)
    direct = kind(routed.client(routed.replicas[1].url), stream)
    assert len(via_router[0]) == 8 and via_router[2] == "length", via_router
    assert via_router[3] > 0
    assert via_router == direct


def test_stream_ends_with_done_and_key_is_enforced(routed: Routed) -> None:
    body = {"model": MODEL_NAME, "prompt": "done?", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", routed.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) > 1, lines
    with pytest.raises(openai.AuthenticationError):
        routed.client(api_key="wrong").completions.create(model=MODEL_NAME, prompt="x",
                                                          max_tokens=1)
    models = routed.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


# -- prefix affinity --------------------------------------------------------------------------
def _successes(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith(SUCCESS))


def _hit_ratio(before: dict[str, float], after: dict[str, float]) -> float:
    """Prefix-cache hits / blocks looked up between two scrapes of one replica."""
    queries = after[QUERIES] - before[QUERIES]
    assert queries > 0, (before, after)
    return (after[HITS] - before[HITS]) / queries


def _served(routed: Routed, before: list[dict[str, float]], n: int) -> list[dict[str, float]]:
    """The replicas' metrics once ``n`` more requests than in ``before`` have finished."""
    while True:
        after = routed.metrics()
        if sum(_successes(a) - _successes(b) for a, b in zip(after, before)) >= n:
            return after
        assert routed.remaining() > 0
        time.sleep(0.05)


def _seed_together(routed: Routed, send: Any, keys: list[str]) -> list[float]:
    """Sends one request per key at once (so the router sees them all in flight); how many
    each replica served."""
    before = routed.metrics()
    barrier = threading.Barrier(len(keys))

    def one(key: str) -> None:
        barrier.wait(timeout=10)
        send(key)

    with ThreadPoolExecutor(len(keys)) as pool:
        list(pool.map(one, keys))
    after = _served(routed, before, len(keys))
    return [_successes(a) - _successes(b) for a, b in zip(after, before)]


# Distinct first characters: no two prefixes share even their first KV block.
NAMES = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]


def _prefix(name: str) -> str:
    return f"{name.capitalize()}: " + " ".join(f"{name}{i}" for i in range(8)) + ". Next: "


def test_shared_prefixes_stick_to_one_replica_distinct_ones_spread(routed: Routed) -> None:
    client = routed.client()

    def seed(name: str) -> None:  # long enough that all six are in flight together
        r = client.completions.create(model=MODEL_NAME, prompt=_prefix(name) + "seed",
                                      max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 32

    seeded = _seed_together(routed, seed, NAMES)
    assert sum(seeded) == len(NAMES) and min(seeded) >= 1, f"distinct prefixes not spread: {seeded}"

    home: dict[str, int] = {}
    for name in NAMES:
        for q in range(3):
            before = routed.metrics()
            r = client.completions.create(model=MODEL_NAME, prompt=_prefix(name) + f"q{q}?",
                                          max_tokens=2, temperature=0)
            after = _served(routed, before, 1)
            done = [_successes(a) - _successes(b) for a, b in zip(after, before)]
            prompt = [a[PROMPT_TOKENS] - b[PROMPT_TOKENS] for a, b in zip(after, before)]
            assert sorted(done) == [0, 1], (name, q, done)
            i = done.index(1)
            assert prompt[i] == r.usage.prompt_tokens and prompt[1 - i] == 0, (name, q, prompt)
            # Only this prefix's seed (and earlier follow-ups) cached these blocks: a replica
            # without them finds none (distinct first blocks), and its rate would not rise.
            assert _hit_ratio(before[i], after[i]) >= 0.5, (name, q, before[i], after[i])
            assert after[i][HIT_RATE] > before[i][HIT_RATE], (name, q, before[i], after[i])
            assert home.setdefault(name, i) == i, f"{name} moved: {home[name]} -> {i} (q{q})"
    assert set(home.values()) == {0, 1}, f"shared-prefix traffic all on one replica: {home}"


def test_chats_sharing_a_system_prompt_stick_to_one_replica(routed: Routed) -> None:
    client = routed.client()

    def ask(name: str, question: str, max_tokens: int) -> None:
        client.chat.completions.create(
            model=MODEL_NAME, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "system", "content": _prefix(name)},
                      {"role": "user", "content": question}], extra_body={"ignore_eos": True})

    names = [n.upper() for n in NAMES[:4]]
    seeded = _seed_together(routed, lambda n: ask(n, "seed", 32), names)
    assert min(seeded) >= 1, f"distinct system prompts not spread: {seeded}"
    home: dict[str, int] = {}
    for name in names:
        for q in ("first?", "second?"):
            before = routed.metrics()
            ask(name, q, 2)
            after = _served(routed, before, 1)
            done = [_successes(a) - _successes(b) for a, b in zip(after, before)]
            assert sorted(done) == [0, 1], (name, q, done)
            i = done.index(1)
            assert _hit_ratio(before[i], after[i]) >= 0.5, (name, q, before[i], after[i])
            assert home.setdefault(name, i) == i, f"{name} moved: {home[name]} -> {i} ({q})"
    assert set(home.values()) == {0, 1}, home


# -- run.sh without a router ------------------------------------------------------------------
def test_run_sh_checks_its_arguments(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in RUN_SH_VARS}

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(RUN_SH), *args], env={**env, **extra},
                              capture_output=True, text=True, timeout=10)

    for args in ((), ("127.0.0.1:8001",), ("--", "--policy", "random")):
        r = run(*args)
        assert r.returncode == 2 and "usage:" in r.stderr, (args, r.stderr)
    r = run("http://127.0.0.1:8001", VLLM_ROUTER=str(tmp_path / "missing"))
    assert r.returncode == 127 and "pip install vllm-router" in r.stderr, r.stderr
    # What it runs: a stand-in router that prints its arguments.
    fake = tmp_path / "fake-router"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    r = run("http://a:1/", "http://b:2", "--", "--log-level", "debug", VLLM_ROUTER=str(fake),
            ROUTER_PORT="9999")
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split("\n")
    assert argv[argv.index("--worker-urls") + 1:argv.index("--worker-urls") + 3] == [
        "http://a:1", "http://b:2"]
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--port") + 1] == "9999"
    assert argv[-3:] == ["--log-level", "debug", ""]
