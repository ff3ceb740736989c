"""Server-sent events, and noticing that a client has gone.

A request must be aborted (its KV blocks freed) as soon as its client disconnects. For a
stream, ``SSEResponse`` listens for the disconnect while it sends, stops sending and closes
the event generator, whose cleanup aborts the request. For a plain response,
``run_unless_disconnected`` races the handler against the disconnect and cancels it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, TypeVar
from collections.abc import Awaitable

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def sse_data(obj: Any) -> str:
    """One event: a pydantic model (None fields left out) or a JSON-able value."""
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json(exclude_none=True)
    else:
        payload = json.dumps(obj)
    return f"data: {payload}\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """A text/event-stream response that stops at once when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, send_timeout: float | None = None, **kw: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        headers.update(kw.pop("headers", None) or {})
        super().__init__(content, headers=headers, **kw)
        # A client that stops reading blocks our sends once the socket buffers are full;
        # after this long the stream ends (its request is aborted, the connection closed).
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.send_timeout is not None:
            send = _timed_send(send, self.send_timeout)
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away while we were sending
                        logger.debug("client gone while streaming")
                    except TimeoutError:
                        logger.warning("a stream's client read nothing for %s s; closing it",
                                       self.send_timeout)
                    tg.cancel_scope.cancel()

                async def listen() -> None:
                    await _wait_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(listen)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def _timed_send(send: Send, timeout: float) -> Send:
    async def timed(message: Any) -> None:
        with anyio.fail_after(timeout):
            await send(message)
    return timed


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, unless the client disconnects first: then work is cancelled (its
    cleanup aborts the engine request) and None is returned (nobody reads the answer)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, task, return_exceptions=True)
    if task.cancelled():
        logger.debug("client gone; request cancelled")
        return None
    return task.result()
