"""`vllm-lite serve` as a separate process: it binds to loopback by default, serves, and
stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import vllm_lite

TIMEOUT = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subcommand(model_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    # The vllm_lite these tests import (installed, or the checkout), whatever the cwd.
    home = str(Path(vllm_lite.__file__).resolve().parent.parent)
    env = {**os.environ, "VLLM_LITE_API_KEY": "k3y",
           "PYTHONPATH": os.pathsep.join([home] + [p for p in os.environ.get(
               "PYTHONPATH", "").split(os.pathsep) if p])}
    cmd = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--dtype", "float32", "--device", "cpu", "--block-size", "4",
           "--kv-cache-space", "0.01", "--served-model-name", "tiny", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.get(url + "/v1/models", timeout=TIMEOUT).status_code == 401
        models = httpx.get(url + "/v1/models", headers=auth, timeout=TIMEOUT).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=TIMEOUT,
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        if os.path.exists("/proc/net/tcp"):  # loopback only, unless told otherwise
            assert _listening_addresses(port) == ["127.0.0.1"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    # uvicorn re-raises the signal once it has shut down gracefully.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Traceback" not in out, out


def _listening_addresses(port: int) -> list[str]:
    """The IPv4 addresses with a socket listening on ``port`` (Linux /proc/net/tcp)."""
    addresses = []
    with open("/proc/net/tcp") as f:
        for row in f.readlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            ip_hex, port_hex = local.split(":")
            if int(port_hex, 16) == port and state == "0A":  # 0A: LISTEN
                addresses.append(".".join(str(b) for b in reversed(bytes.fromhex(ip_hex))))
    return addresses
