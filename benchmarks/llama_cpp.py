"""llama.cpp's ``llama-server`` as a throughput peer (engine ``llama_cpp``).

``benchmarks/peers/llama_cpp.sh`` builds ``llama-server`` and ``llama-quantize`` (CPU, static)
from the source the PyPI sdist of llama-cpp-python vendors and converts the default GGUF
to F32 / BF16 / Q8_0 next to them (``<root>/llama.cpp-<version>/{bin,models}``). A run
starts the server with N slots and one unified KV cache (``-np N -kvu``), the benchmark's
thread count, sends every request at once as token ids to ``/completion`` (``n_predict`` =
its output length, ``ignore_eos``, ``cache_prompt: false``, greedy: ``top_k`` 1), one
client thread per request, and times from the first send to the last answer. The server
is stopped afterwards.

Every timed run starts with every slot erased (``POST /slots/<id>?action=erase``, which the
server offers only with ``--slot-save-path``; nothing is saved). A finished request's KV
stays in its slot's part of the unified cache otherwise, and a second run on the same
server read 19-22% slower than the first (bf16, this workload: 164 tok/s, then 133, 128,
130; with the slots erased 163, 153, 178, 174). vllm_lite frees a finished request's
blocks, so each run of either engine starts from an empty cache.

Which GGUF: the run's precision picks the file: float32 -> F32, bfloat16 -> BF16,
``quantization="int8"`` -> Q8_0, ``"int4"`` -> the original Q4_1 file; ``"gguf"`` (the
default for a quantized GGUF model) -> the model's own GGUF file, the blocks vllm_lite keeps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from .engines import LLAMA_CPP, RunResult, _progress, median_run
from .workload import BenchRequest

logger = logging.getLogger(__name__)

PEERS_ROOT = Path(os.environ.get("VLLM_LITE_PEERS", Path.home() / ".cache" / "vllm_lite" / "peers"))
# GGUF type of each precision the throughput benchmark runs.
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0", "int4": "Q4_1",
              "gguf": "Q4_1"}


def find_bin(explicit: str | None) -> Path:
    """The folder holding llama-server: ``explicit``, else the newest build of
    benchmarks/peers/llama_cpp.sh. ValueError when there is none."""
    if explicit:
        folder = Path(explicit).expanduser()
    else:
        builds = sorted(PEERS_ROOT.glob("llama.cpp-*/bin"), key=lambda p: p.stat().st_mtime)
        if not builds:
            raise ValueError("no llama.cpp build found under "
                             f"{PEERS_ROOT}; run `bash benchmarks/peers/llama_cpp.sh` first "
                             "or pass --llama-cpp-bin")
        folder = builds[-1]
    if not (folder / "llama-server").is_file():
        raise ValueError(f"--llama-cpp-bin: {folder} has no llama-server")
    return folder


def model_file(bin_dir: Path, precision: str) -> Path:
    """The converted GGUF of ``precision`` next to the build (ValueError if missing)."""
    if precision not in GGUF_TYPES:
        raise ValueError(f"llama_cpp has no GGUF type for {precision!r}")
    kind = GGUF_TYPES[precision]
    files = sorted((bin_dir.parent / "models").glob(f"*.{kind}.gguf"))
    if not files:
        raise ValueError(f"no {kind} GGUF in {bin_dir.parent / 'models'}; run "
                         "`bash benchmarks/peers/llama_cpp.sh` to convert the model")
    return files[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class ServerExited(RuntimeError):
    """llama-server ended before it answered /health; ``returncode`` is its exit status
    (negative: the signal that killed it)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class LlamaServer:
    """A llama-server process on a free loopback port (a context manager); ``extra_args``
    are added to its command line."""

    def __init__(self, bin_dir: Path, gguf: Path, slots: int, ctx_tokens: int, threads: int,
                 log_path: Path, extra_args: Sequence[str] = ()) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.slots = slots
        # Only enables the slot actions (erase_slots); nothing is ever saved there.
        self.slot_dir = tempfile.mkdtemp(prefix="vllm_lite_llama_slots_")
        self.cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
                    "--port", str(self.port), "-np", str(slots), "-kvu", "-c", str(ctx_tokens),
                    "-t", str(threads), "-tb", str(threads), "-ngl", "0", "--no-webui",
                    "--slot-save-path", self.slot_dir, *extra_args]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise ServerExited(f"llama-server exited with {self.proc.returncode}; "
                                   f"see {self.log_path}", self.proc.returncode)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not become healthy in 120 s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.slot_dir, ignore_errors=True)

    def cpu_seconds(self) -> float | None:
        """The server's user + system CPU time so far (Linux /proc), or None."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, AttributeError):
            return None

    def erase_slots(self, timeout: float) -> None:
        """Drops every slot's cached tokens and KV: the state of a fresh server."""
        for slot in range(self.slots):
            _post(f"{self.url}/slots/{slot}?action=erase", {}, timeout)

    def complete(self, req: BenchRequest, timeout: float) -> int:
        """Runs one request; the number of tokens it generated."""
        out = _post(self.url + "/completion", {
            "prompt": list(req.prompt_token_ids), "n_predict": req.output_len,
            "ignore_eos": True, "cache_prompt": False, "top_k": 1, "temperature": 0.0,
            "stream": False}, timeout)
        return int(out.get("tokens_predicted", 0))


def _start(bin_dir: Path, gguf: Path, slots: int, ctx: int, threads: int,
           log_path: Path) -> tuple[LlamaServer, list[str]]:
    """A running server (entered: the caller exits it) and the extra flags it needed.

    A server killed by a signal while loading is started once more with --no-repack:
    ggml's AMX kernels for quantized weights (an "extra buffer type", like the repacked
    layouts) segfault on some CPUs, e.g. the default model's Q8_0 and Q4_1 on this
    project's Xeon VM, and --no-repack turns the extra buffer types off.
    """
    try:
        return LlamaServer(bin_dir, gguf, slots, ctx, threads, log_path).__enter__(), []
    except ServerExited as e:
        if e.returncode >= 0:
            raise
        logger.warning("llama-server died while loading (%s); starting it again with "
                       "--no-repack", e)
        extra = ["--no-repack"]
        return LlamaServer(bin_dir, gguf, slots, ctx, threads, log_path, extra).__enter__(), extra


def run_llama_cpp(bin_dir: Path, gguf: Path, requests: Sequence[BenchRequest], threads: int,
                  slots: int, log_path: Path, progress: bool = False,
                  timeout_s: float = 3600.0, precision: str = "", repeats: int = 1) -> RunResult:
    """Every request sent at once to a fresh server; see the module docstring. ``repeats``
    timed runs on that server, the median one returned (median_run)."""
    slots = max(1, min(slots, len(requests)))
    longest = max(r.prompt_len + r.output_len for r in requests)
    # The unified cache holds every slot's sequence at once (a slot's context is this too).
    ctx = max(longest, sum(sorted((r.prompt_len + r.output_len for r in requests),
                                  reverse=True)[:slots]))
    with contextlib.ExitStack() as stack:
        server, extra = _start(bin_dir, gguf, slots, ctx, threads, log_path)
        stack.push(server)  # its __exit__ stops it
        warm = BenchRequest(list(requests[0].prompt_token_ids[:8]), 4)
        server.complete(warm, timeout_s)

        def timed_run() -> RunResult:
            server.erase_slots(timeout_s)  # untimed: each run starts from an empty cache
            bar = _progress(len(requests), LLAMA_CPP, progress)
            cpu0 = server.cpu_seconds()

            def one(req: BenchRequest) -> int:
                n = server.complete(req, timeout_s)
                bar.update(1)
                return n

            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(requests)) as pool:
                lens = list(pool.map(one, requests))
            elapsed = time.perf_counter() - start
            cpu1 = server.cpu_seconds()
            bar.close()
            # CPU time the server got / (wall time x its threads), as CpuShare for vllm_lite.
            share = ((cpu1 - cpu0) / (elapsed * threads) if cpu0 is not None
                     and cpu1 is not None else None)
            return RunResult(
                engine=LLAMA_CPP, num_requests=len(requests), elapsed_s=elapsed,
                prompt_tokens=sum(r.prompt_len for r in requests),
                output_tokens=sum(min(n, r.output_len) for n, r in zip(lens, requests)),
                generated_tokens=sum(lens), output_lens=lens, cpu_share=share,
                settings={"precision": precision, "gguf": gguf.name, "slots": slots,
                          "ctx_tokens": ctx, "threads": threads, "unified_kv": True,
                          "extra_args": extra},
            )

        result = median_run(timed_run, repeats)
    lens = result.output_lens
    short = sum(1 for n, r in zip(lens, requests) if n < r.output_len)
    notes = [f"{short} request(s) ended before their output length"] if short else []
    if extra:
        notes.append(f"run with {' '.join(extra)}: the server died while loading without it")
    if notes:
        result.note = "; ".join(notes)
    return result
