"""Chat templates rendered with a deadline and a size cap, out of the engine's process.

A model's chat template is code from the model file. The engine never runs it itself: each
thread that renders (the caller of ``LLM.chat``, each of the server's tokenizer threads) has
its own renderer process (:mod:`vllm_lite.entrypoints.chat_template_worker`), which runs
under an address-space limit. A render that passes ``chat_template_timeout`` seconds is
stopped by killing that process (the next render starts a fresh one); one whose text passes
``chat_template_max_chars`` characters is stopped as it writes. Either, and every error of
the template itself (a syntax error, ``raise_exception``, a sandbox ``SecurityError``), is a
ValueError naming the template, which the server answers with a 400.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The renderer process's address-space limit. Rendering a prompt takes a few MB; this
#: leaves room for the interpreter and jinja2 and for the largest text the cap allows.
RENDERER_MEMORY_BYTES = 1 << 30

_WORKER_FILE = Path(__file__).with_name("chat_template_worker.py")
# Run as a script by path: importing the vllm_lite package would pull in torch. The
# script's folder is dropped from sys.path so nothing beside it shadows a module.
_BOOT = ("import runpy, sys; del sys.path[0]; sys.argv = sys.argv[1:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')")
# How long a fresh renderer may take to start (not counted in the render's own deadline).
_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ChatTemplateLimits:
    """What one render may take (the values are EngineArgs' chat_template_* options)."""

    timeout_s: float
    max_chars: int


class _Renderer:
    """One renderer process, used by one thread at a time."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(_WORKER_FILE), str(RENDERER_MEMORY_BYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            bufsize=0)
        self._finalizer = weakref.finalize(self, _stop, proc)
        line = _read_line(proc, time.monotonic() + _START_TIMEOUT_S)
        if line is None or json.loads(line) != {"ready": True}:
            _stop(proc)
            raise RuntimeError("the chat-template renderer process did not start "
                               f"({sys.executable} {_WORKER_FILE})")
        return proc

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.proc = None

    def render(self, source: str, context: dict[str, Any], limits: ChatTemplateLimits,
               name: str) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        request = json.dumps({"template": source, "context": context,
                              "max_chars": limits.max_chars})
        deadline = time.monotonic() + limits.timeout_s
        try:
            self.proc.stdin.write(request.encode("utf-8") + b"\n")  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            self.close()
            raise ValueError(f"the chat template of {name} could not be rendered: its "
                             "renderer process died") from None
        line = _read_line(self.proc, deadline)
        if line is None:
            timed_out = self.proc.poll() is None
            self.close()
            if timed_out:
                raise ValueError(f"the chat template of {name} did not finish within "
                                 f"chat_template_timeout ({limits.timeout_s:g} s); it was "
                                 "stopped") from None
            raise ValueError(f"the chat template of {name} could not be rendered: its renderer "
                             f"process died (memory limit {RENDERER_MEMORY_BYTES >> 20} MiB)")
        answer = json.loads(line)
        if "text" in answer:
            return answer["text"]
        if answer.get("kind") == "too_long":
            raise ValueError(f"the chat template of {name} wrote more than "
                             f"chat_template_max_chars ({limits.max_chars}) characters; it was "
                             "stopped")
        if answer.get("kind") == "memory":
            raise ValueError(f"the chat template of {name} needed more than its "
                             f"{RENDERER_MEMORY_BYTES >> 20} MiB memory limit")
        raise ValueError(f"the chat template of {name} failed: {answer['error']}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        logger.warning("chat-template renderer %d did not exit after SIGKILL", proc.pid)
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass


def _read_line(proc: subprocess.Popen, deadline: float) -> str | None:
    """The process's next line, or None at the deadline or when it exits first."""
    out = proc.stdout
    assert out is not None
    fd = out.fileno()
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            return None
        data = os.read(fd, 1 << 20)
        if not data:
            return None
        chunks.append(data)
        if data.endswith(b"\n"):  # the worker writes one line (ASCII JSON) per answer
            return b"".join(chunks).decode("ascii")


_local = threading.local()


def _thread_renderer() -> _Renderer:
    # One per thread: a render blocks its process, and the server renders on several
    # tokenizer threads at once. A thread's renderer stops when the thread ends.
    renderer = getattr(_local, "renderer", None)
    if renderer is None:
        renderer = _local.renderer = _Renderer()
    return renderer


def template_context(tokenizer: Any, conversation: list[dict[str, Any]],
                     add_generation_prompt: bool) -> dict[str, Any]:
    """The variables a chat template sees, as transformers' ``apply_chat_template`` passes
    them: the messages (keys whose value is None dropped), no tools or documents, the
    generation-prompt flag and the tokenizer's named special tokens."""
    context: dict[str, Any] = {}
    for key, value in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        context[key] = [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value)
    messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
    context.update(messages=messages, tools=None, documents=None,
                   add_generation_prompt=bool(add_generation_prompt))
    return context


def render_chat_template(tokenizer: Any, conversation: list[dict[str, Any]],
                         add_generation_prompt: bool, limits: ChatTemplateLimits,
                         name: str = "the model") -> str:
    """The prompt text of ``conversation`` (a list of {"role", "content", ...} dicts) through
    the tokenizer's chat template, rendered in the calling thread's renderer process within
    ``limits``. ValueError naming the template when it has none, fails, or passes a limit."""
    try:
        source = tokenizer.get_chat_template()
    except ValueError as e:
        raise ValueError(f"{name} has no usable chat template: {e}") from None
    if not isinstance(source, str):
        raise ValueError(f"the chat template of {name} is not text")
    try:
        context = template_context(tokenizer, conversation, add_generation_prompt)
        json.dumps(context)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the chat messages must be JSON-like data (str, numbers, lists, "
                         f"dicts): {e}") from None
    return _thread_renderer().render(source, context, limits, name)
