"""Tokenization off the event loop.

Tokenizing a long prompt or applying a chat template takes real time (seconds for a few
MB of text); done on the event loop it would stall every other client, /health included.
The server runs each request's checks and tokenization on a few worker threads instead.
A fast tokenizer must not be used by two threads at once, so each worker thread gets its
own copy; ``current()`` hands the calling thread the copy that is its own (the event
loop's thread keeps one too, for the cheap per-token decodes of the responses).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from collections.abc import Callable

T = TypeVar("T")


class TokenizerPool:
    def __init__(self, tokenizer: Any, num_threads: int) -> None:
        self._base = tokenizer
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="vllm_lite-tokenizer",
            initializer=self._init_thread)

    def _init_thread(self) -> None:
        self._local.tokenizer = copy.deepcopy(self._base)

    def current(self) -> Any:
        """The calling thread's own tokenizer (None when the model has none)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None and self._base is not None:
            tok = self._local.tokenizer = copy.deepcopy(self._base)
        return tok

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a tokenizer thread; its exceptions come back unchanged."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
