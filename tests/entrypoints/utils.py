"""A real uvicorn server on 127.0.0.1 (a free port) in a background thread, for tests."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import vllm_lite

from vllm_lite import LLM
from vllm_lite.entrypoints.openai.api_server import ServerConfig, build_app, uvicorn_config

logger = logging.getLogger(__name__)

MODEL_NAME = "tiny-llama"
VOCAB = 320
EOS = 0


def make_llm(folder: Path, **kw: Any) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_space", 0.01)
    kw.setdefault("swap_space", 0.01)
    return LLM(str(folder), dtype="float32", device="cpu", **kw)


def fail_steps_with(llm: LLM, poison: int) -> None:
    """From now on, a step whose batch holds a prompt with token ``poison`` raises in the
    model runner (an injected engine failure); ``del llm.llm_engine.runner.execute_model``
    undoes it."""
    runner = llm.llm_engine.runner
    execute = runner.execute_model

    def failing(out: Any, *args: Any, **kw: Any) -> Any:
        if any(poison in s.seq_group.prompt_token_ids for s in out.scheduled_seq_groups):
            raise RuntimeError("injected failure")
        return execute(out, *args, **kw)

    runner.execute_model = failing


class ServerThread:
    """``with ServerThread(llm, ServerConfig(...)) as srv: srv.url`` -- serves until exit."""

    def __init__(self, llm: LLM, config: ServerConfig | None = None,
                 start_timeout: float = 30.0) -> None:
        import uvicorn

        self.config = config or ServerConfig(served_model_name=MODEL_NAME)
        self.app = build_app(llm.llm_engine, self.config)
        self.engine = self.app.state.engine
        self.start_timeout = start_timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn_config(self.app, self.config, log_level="warning", lifespan="on")
        cfg.timeout_graceful_shutdown = 2
        self.server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()
        if self._thread.is_alive():
            logger.warning("the test server on port %d did not stop", self.port)

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a ``python -m vllm_lite.entrypoints.cli`` child: the vllm_lite
    these tests import (installed, or the checkout), whatever the cwd."""
    home = str(Path(vllm_lite.__file__).resolve().parent.parent)
    return {**os.environ, **(extra or {}),
            "PYTHONPATH": os.pathsep.join([home] + [p for p in os.environ.get(
                "PYTHONPATH", "").split(os.pathsep) if p])}


def run_python_json(code: str, *args: str, env: dict[str, str] | None = None,
                    unset: tuple[str, ...] = ()) -> Any:
    """Runs ``python -c code *args`` in a fresh process (for what pins or tunes the whole
    process) with the vllm_lite these tests import (installed in CI, where the checkout
    has no _C) and the tests folder importable, from "/" so the checkout is not on the
    path; returns the JSON of its last stdout line. ``unset``: variables removed from the
    environment before ``env`` is added."""
    child_env = cli_env()
    for name in unset:
        child_env.pop(name, None)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join(
        [child_env["PYTHONPATH"], str(Path(__file__).resolve().parents[1])])
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=300, env=child_env, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class ServeProcess:
    """``vllm-lite serve`` on the tiny model in a child process (the real entry point:
    signals, exit status, logs), on 127.0.0.1:``port``.

        proc = ServeProcess(model_dir, tmp_path, port, ["--drain-timeout", "5"]).start()
        proc.wait_healthy(); ...; rc, log = proc.stop()
    """

    def __init__(self, model_dir: Path, cwd: Path, port: int | None = None,
                 args: list[str] = (), env: dict[str, str] | None = None) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = cli_env(env)
        self.cmd = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve",
                    "--model", str(model_dir), "--port", str(self.port), "--dtype", "float32",
                    "--device", "cpu", "--block-size", "4", "--kv-cache-space", "0.01",
                    "--served-model-name", MODEL_NAME, "--log-level", "warning",
                    "--threads", "1", *args]
        self.cwd = cwd
        self.log_path = cwd / f"serve_{self.port}_{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServeProcess:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=self._log,
                                     stderr=subprocess.STDOUT, text=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def wait_healthy(self, timeout: float = 120) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{self.url} did not come up\n{self.log()}"
            time.sleep(0.2)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30) -> tuple[int, str]:
        """SIGTERM, then SIGKILL past ``timeout``: (exit status, the log)."""
        if self.proc is None:
            return 0, ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode, self.log()


def token_ids(logprobs_tokens: list[str]) -> list[int]:
    """Token ids from logprob tokens sent with return_tokens_as_token_ids."""
    ids = []
    for t in logprobs_tokens:
        m = re.fullmatch(r"token_id:(\d+)", t)
        assert m, t
        ids.append(int(m.group(1)))
    return ids


def offline_params(body: dict[str, Any]) -> Any:
    """The offline SamplingParams of a /v1/completions body."""
    from vllm_lite import SamplingParams

    return SamplingParams(n=body.get("n", 1), temperature=body["temperature"],
                          seed=body.get("seed"), max_tokens=body["max_tokens"],
                          ignore_eos=body.get("ignore_eos", False))


async def complete_ids(client: Any, body: dict[str, Any]) -> dict[int, list[int]]:
    """A plain completion (logprobs=0, return_tokens_as_token_ids): index -> token ids."""
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return {c["index"]: token_ids(c["logprobs"]["tokens"]) for c in r.json()["choices"]}


class IncompleteStream(Exception):
    """A stream that ended without ``data: [DONE]``; ``token_ids`` holds what came."""

    def __init__(self, token_ids: dict[int, list[int]]) -> None:
        super().__init__(f"the stream ended without [DONE] after {token_ids}")
        self.token_ids = token_ids


async def stream_ids(client: Any, body: dict[str, Any],
                     cancel: bool = False) -> dict[int, list[int]]:
    """A streamed completion read to ``data: [DONE]`` (or, ``cancel``, left after its first
    token): index -> token ids. IncompleteStream if it ends early."""
    got: dict[int, list[int]] = {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code} {r.headers.get('x-upstream', '')}: "
                                 f"{(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return got
            event = json.loads(data)
            assert "error" not in event, event
            for c in event["choices"]:
                got.setdefault(c["index"], []).extend(token_ids(c["logprobs"]["tokens"]))
            if cancel and got.get(0):
                return got  # leaving the block closes the connection mid-stream
    raise IncompleteStream(got)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def read_metrics(text: str) -> dict[str, float]:
    """'name{labels}' -> value of a Prometheus text exposition (model_name label dropped)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        name, labels, value = m.groups()
        pairs = [p for p in re.findall(r'[a-zA-Z_]\w*="[^"]*"', labels or "")
                 if not p.startswith("model_name=")]
        values[name + ("{" + ",".join(pairs) + "}" if pairs else "")] = float(value)
    return values
