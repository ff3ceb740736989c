"""AsyncLLMEngine: an LLMEngine driven by one background thread, used from asyncio.

    engine = AsyncLLMEngine(llm_engine)         # LLM(...).llm_engine, for one
    engine.start()
    async for out in engine.generate("req-1", prompt_token_ids=ids, sampling_params=p):
        ...                                     # a RequestOutput after each step it ran in
    engine.abort("req-2")                       # frees its blocks before the next step
    engine.shutdown()

An engine step is synchronous torch work, so it runs in a dedicated thread and the event
loop stays responsive. That thread alone touches the LLMEngine: requests to add and abort
are queued under a lock and applied between steps. Each request has a one-slot stream on
the loop that called ``generate`` holding its newest (cumulative) output, so a slow
consumer costs no memory; one that reads nothing for ``stream_timeout`` seconds is
aborted. Leaving the ``async for`` early (client gone, task
cancelled) aborts the request.

Callers validate requests first (``LLMEngine.admission``, ``SamplingParams``); a
ValueError the engine still raises on adding comes back from ``generate`` unchanged. A step
that raises fails the requests that were running in it with ``EngineError`` (their blocks
are freed) and the engine goes on serving the others.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import AsyncIterator, Callable, Sequence

from vllm_lite.engine.llm_engine import EngineStepError
from vllm_lite.metrics import Metrics
from vllm_lite.outputs import RequestOutput
from vllm_lite.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving a request (not the request's fault)."""


class EngineDeadError(EngineError):
    """The engine is shut down, or its thread died."""


@dataclass
class _PendingAdd:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    priority: int
    arrival: float


class _Stream:
    """One request's outputs, handed from the engine thread to the event loop that waits
    for them.

    Bounded: a RequestOutput is cumulative (all tokens, text and logprobs so far), so only
    the newest one is kept; a consumer that falls behind gets the latest state, never a
    growing backlog. ``pending_since`` says how long an output has waited unread (a client
    that stops reading a stream is aborted after the engine's stream timeout).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.finished = False
        self._lock = threading.Lock()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self.pending_since: float | None = None

    def put(self, item: Any) -> None:
        """Engine thread (or any thread): a RequestOutput, or an exception that ends the
        stream."""
        with self._lock:
            if self._error is not None:
                return  # already ended
            if isinstance(item, BaseException):
                self._error = item
            else:
                self._latest = item
            if self.pending_since is None:
                self.pending_since = time.monotonic()
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get(self) -> Any:
        """The newest output (or the error), waiting for one."""
        while True:
            with self._lock:
                if self._latest is not None:
                    item, self._latest = self._latest, None
                elif self._error is not None:
                    item = self._error
                else:
                    item = None
                if item is not None:
                    self.pending_since = None
                    return item
                self.event.clear()
            await self.event.wait()

    def unread_for(self, now: float) -> float:
        with self._lock:
            return 0.0 if self.pending_since is None else now - self.pending_since


class AsyncLLMEngine:
    def __init__(self, engine: Any, metrics: Metrics | None = None,
                 stream_timeout: float | None = None, batching_delay: float = 0.0) -> None:
        self.engine = engine
        self.metrics = metrics
        # Seconds an idle engine holds the first request that arrives (or until
        # max_num_seqs requests wait) so a burst shares its first prefill step.
        if not 0 <= batching_delay < float("inf"):
            raise ValueError(f"batching_delay must be >= 0 seconds, got {batching_delay}")
        self.batching_delay = batching_delay
        self._max_batch = engine.config.scheduler_config.max_num_seqs
        # Seconds an output may wait unread before its request is aborted (a client that
        # stopped reading must not hold KV blocks forever); None: no limit.
        if stream_timeout is not None and not stream_timeout > 0:
            raise ValueError(f"stream_timeout must be > 0 seconds, got {stream_timeout}")
        self.stream_timeout = stream_timeout
        self._cv = threading.Condition()
        # Guarded by _cv: what the engine thread applies before its next step.
        self._adds: list[_PendingAdd] = []
        self._aborts: set[str] = set()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        # Called by the engine thread after each step with the step's outputs (tests hook
        # here to observe steps).
        self.step_callbacks: list[Callable[[list[RequestOutput]], None]] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._thread = threading.Thread(target=self._run, name="vllm_lite-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the engine thread after its current step; waiting requests fail with
        EngineDeadError and leave the engine (their blocks are freed)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %s s", timeout)
                return
        self._fail_everything(EngineDeadError("the engine is shut down"))
        self.engine.shutdown()  # tensor-parallel ranks exit

    @property
    def num_requests(self) -> int:
        """Requests in this engine now: waiting to be added, waiting, or running."""
        with self._cv:
            return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | None = None,
                       sampling_params: SamplingParams | None = None,
                       prompt_token_ids: Sequence[int] | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields the request's RequestOutput after each step it ran in, the last one
        with ``finished=True``."""
        if prompt_token_ids is None and prompt is None:
            raise ValueError("give a prompt or prompt_token_ids")
        stream = _Stream(asyncio.get_running_loop())
        # A text prompt is tokenized by the engine thread: the engine's tokenizer is not
        # to be used from two threads at once.
        pending = _PendingAdd(request_id, prompt,
                              None if prompt_token_ids is None else list(prompt_token_ids),
                              sampling_params if sampling_params is not None else SamplingParams(),
                              priority, time.monotonic())
        with self._cv:
            if not self.is_running:
                raise EngineDeadError("the engine is not running") from self._dead
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in the engine")
            self._streams[request_id] = stream
            self._adds.append(pending)
            self._cv.notify_all()
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            with self._cv:
                self._streams.pop(request_id, None)
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request (unknown ids are ignored): it leaves the engine and frees its
        blocks before the next step. Safe to call from any thread, even while a task is
        being cancelled."""
        with self._cv:
            before = len(self._adds)
            self._adds = [a for a in self._adds if a.request_id != request_id]
            if len(self._adds) == before:
                self._aborts.add(request_id)
            stream = self._streams.get(request_id)
            self._cv.notify_all()
        if stream is not None and not stream.finished:
            stream.put(asyncio.CancelledError(f"request {request_id} aborted"))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            self._publish_stats()
            while True:
                with self._cv:
                    while not (self._stopping or self._adds or self._aborts
                               or engine.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopping:
                        return
                    if self.batching_delay > 0 and self._adds and \
                            not engine.has_unfinished_requests():
                        self._hold_for_batch()
                        if self._stopping:
                            return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, set()
                self._apply_aborts(aborts)
                self._apply_adds(adds)
                if engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
        except BaseException as e:  # a bug outside a step: nothing can be served any more
            logger.exception("the engine thread died")
            self._dead = e
            with self._cv:
                self._stopping = True
            self._fail_everything(EngineDeadError(f"the engine thread died: {e!r}"))

    def _hold_for_batch(self) -> None:
        """Under _cv, the engine idle and a request pending: waits until the batching delay
        has passed since the first pending request arrived, max_num_seqs requests are
        pending, every pending one was aborted, or the engine stops."""
        deadline = self._adds[0].arrival + self.batching_delay
        while not self._stopping and 0 < len(self._adds) < self._max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)

    def _apply_aborts(self, aborts: set[str]) -> None:
        if not aborts:
            return
        self.engine.abort_request(list(aborts))
        if self.metrics is not None:
            for rid in aborts:
                self.metrics.on_request_aborted(rid)
        logger.debug("aborted %d request(s)", len(aborts))

    def _apply_adds(self, adds: list[_PendingAdd]) -> None:
        for a in adds:
            try:
                self.engine.add_request(a.request_id, a.prompt, a.params,
                                        prompt_token_ids=a.prompt_token_ids, priority=a.priority)
            except ValueError as e:
                self._deliver(a.request_id, e)
                continue
            except Exception as e:  # noqa: BLE001  (this request fails, the engine serves on)
                logger.exception("adding request %s failed", a.request_id)
                self._deliver(a.request_id, EngineError(f"adding the request failed: {e!r}"))
                continue
            if self.metrics is not None:
                self.metrics.on_request_added(
                    a.request_id, self.engine.num_prompt_tokens(a.request_id), a.arrival)

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except EngineStepError as e:
            # The step aborted the requests that broke it (their blocks are free): they
            # fail, everything else goes on with this step's outputs.
            logger.error("engine step failed; failing %d request(s): %s", len(e.request_ids),
                         ", ".join(e.request_ids), exc_info=e.cause)
            err = EngineError(f"the engine failed while running this request: {e.cause!r}")
            failed = set(e.request_ids)
            for rid in e.request_ids:
                if self.metrics is not None:
                    self.metrics.on_request_aborted(rid, "error")
                self._deliver(rid, err)
            outputs = [o for o in e.outputs if o.request_id not in failed]
        if self.metrics is not None:
            self.metrics.on_outputs(outputs)
        with self._cv:
            streams = [(out, self._streams.get(out.request_id)) for out in outputs]
        for out, stream in streams:
            if stream is None:
                if not out.finished:  # nobody listens (its consumer left): stop it
                    self.abort(out.request_id)
                continue
            stream.put(out)
        self._abort_unread()
        for cb in self.step_callbacks:
            cb(outputs)

    def _abort_unread(self) -> None:
        """Aborts the requests whose consumer has not taken an output for stream_timeout
        seconds (a streaming client that stopped reading): their blocks are freed."""
        if self.stream_timeout is None:
            return
        now = time.monotonic()
        with self._cv:
            stale = [(rid, s) for rid, s in self._streams.items()
                     if not s.finished and s.unread_for(now) > self.stream_timeout]
        for rid, stream in stale:
            logger.warning("request %s: its client read nothing for %.0f s; aborting it",
                           rid, self.stream_timeout)
            stream.put(EngineError(f"request {rid} aborted: its client stopped reading "
                                   f"for {self.stream_timeout:g} s"))
            self.abort(rid)

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._cv:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _publish_stats(self) -> None:
        if self.metrics is not None:
            self.metrics.on_engine_stats(self.engine.stats())

    def _fail_everything(self, err: EngineError) -> None:
        with self._cv:
            streams = list(self._streams.items())
            self._adds.clear()
            self._aborts.clear()
        for rid, stream in streams:
            stream.put(err)
        # Only once the thread is gone: nothing else may touch the engine.
        if self._thread is None or not self._thread.is_alive() or \
                threading.current_thread() is self._thread:
            pending = self.engine.unfinished_request_ids()
            try:
                if pending:
                    self.engine.abort_request(pending)
                    if self.metrics is not None:
                        for rid in pending:
                            self.metrics.on_request_aborted(rid)
                self._publish_stats()
            except Exception:  # noqa: BLE001  (a broken engine: nothing more to free)
                logger.exception("freeing the requests left in the engine failed")
