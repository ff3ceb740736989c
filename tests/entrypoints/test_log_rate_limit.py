"""The server's log rate limit (http_limits.RateLimitFilter): a flood of one kind of record
is cut to a burst per window and the next record says how many were dropped; the filter is
put on the process's handlers only while serve() runs and taken off after, so a process
embedding the app (or a test session, whose capture handlers live across tests) keeps
every record."""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_lite.entrypoints.openai.http_limits import (RATE_LIMITED_LOGGERS, RateLimitFilter,
                                                      install_rate_limit, remove_rate_limit)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _logger(name: str) -> tuple[logging.Logger, _Collect]:
    log = logging.getLogger(name)
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = _Collect()
    log.addHandler(handler)
    return log, handler


def test_burst_then_drop_then_count() -> None:
    log, handler = _logger(f"rate_limit_test.{time.monotonic_ns()}")
    f = RateLimitFilter(burst=3, window=0.3)
    install_rate_limit(f, [log.name])
    try:
        for i in range(10):
            log.info("bad request from port %d", 1000 + i)  # one kind: numbers blanked
        log.info("another kind")
        assert len(handler.messages) == 4, handler.messages
        time.sleep(0.35)
        log.info("bad request from port %d", 7)
        assert handler.messages[-1].endswith("[7 similar message(s) suppressed]"), handler.messages
    finally:
        remove_rate_limit(f, [log.name])


def test_removed_filter_lets_everything_through() -> None:
    log, handler = _logger(f"rate_limit_test.{time.monotonic_ns()}")
    f = RateLimitFilter(burst=1, window=60)
    install_rate_limit(f, [log.name])
    remove_rate_limit(f, [log.name])
    assert f not in handler.filters
    for i in range(5):
        log.info("same %d", i)
    assert len(handler.messages) == 5


def test_uvicorn_config_leaves_the_handlers_alone(model_dir: Any) -> None:
    """Building the app's uvicorn config (what an embedding process does) installs no
    filter on anybody's handlers: only serve() does, for as long as it runs."""
    import pytest

    pytest.importorskip("uvicorn")
    from vllm_lite import LLM
    from vllm_lite.entrypoints.openai.api_server import ServerConfig, build_app, uvicorn_config

    llm = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_space=0.01)
    app = build_app(llm.llm_engine, ServerConfig(served_model_name="m"))
    uvicorn_config(app, ServerConfig(served_model_name="m"), log_level="warning")
    for name in RATE_LIMITED_LOGGERS:
        for h in logging.getLogger(name).handlers:
            assert not any(isinstance(f, RateLimitFilter) for f in h.filters), (name, h)
