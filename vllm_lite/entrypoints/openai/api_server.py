"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    vllm-lite serve --model smollm2-135m --host 127.0.0.1 --port 8000 [--api-key KEY]

Endpoints: POST /v1/completions, /v1/chat/completions (``stream=true``: server-sent events
ending with ``data: [DONE]``), GET /v1/models, /health, /get_load (requests in the engine,
for routers), /version, /metrics (Prometheus),
POST /tokenize, /detokenize. With an API key every endpoint but /health and /get_load wants
``Authorization: Bearer KEY``. A bad request is a 400 with an OpenAI error body and never
reaches the engine; an engine failure is a 500 for the requests it hit, and the server
keeps serving.

In Python: ``app = build_app(LLM(...).llm_engine, ServerConfig(...))`` then any ASGI server,
or ``serve(llm_engine, config)`` (blocking, uvicorn).
"""

from __future__ import annotations

import hmac
import logging
import math
import resource
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import vllm_lite
from vllm_lite.config.schema import DEFAULT_MAX_LOGPROBS
from vllm_lite.engine.async_engine import AsyncLLMEngine, EngineError
from vllm_lite.metrics import CONTENT_TYPE, Metrics

from vllm_lite.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from vllm_lite.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm_lite.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm_lite.entrypoints.openai.http_limits import (
    BodyLimitMiddleware,
    HostCheckMiddleware,
    RateLimitFilter,
    guarded_h11_protocol,
    install_rate_limit,
    remove_rate_limit,
)
from vllm_lite.entrypoints.openai.serving_engine import (
    RequestError, ServingLimits, error_body, sse_stream)
from vllm_lite.entrypoints.openai.tokenizer_pool import TokenizerPool
from vllm_lite.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm_lite.entrypoints.openai.sse import SSEResponse, run_unless_disconnected

logger = logging.getLogger(__name__)

# Not behind the API key: load balancers probe them (vllm-router polls /get_load for its
# power_of_two policy without credentials).
_OPEN_PATHS = frozenset({"/health", "/get_load"})
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowed", 408: "RequestTimeout", 413: "RequestEntityTooLarge",
                500: "InternalServerError", 503: "ServiceUnavailable"}


@dataclass
class ServerConfig:
    """How the server listens and what it allows; validated once. Every limit here has a
    ``vllm-lite serve`` flag of the same name (README: "Limits and security")."""

    host: str = "127.0.0.1"
    port: int = 8000
    # The name clients pass as ``model``; None: the --model argument as given.
    served_model_name: str | None = None
    api_key: str | None = None
    max_n: int = 16
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    log_level: str = "info"
    # Seconds a stopping server (SIGTERM, Ctrl-C) gives its in-flight requests to finish
    # once it has stopped accepting connections; then the rest are cut off and it exits.
    drain_timeout_s: float = 30.0
    # Milliseconds an idle engine waits after a request arrives before its first prefill
    # (or until max_num_seqs requests wait), so a burst shares one step: higher throughput
    # for bursts, up to this much more TTFT for a lone request. 0: no wait.
    batching_delay_ms: float = 0.0
    # A request body past this is a 413, refused before it is read.
    max_request_bytes: int = 4 * 1024 * 1024
    # Prompts in one /v1/completions request, messages in one chat request.
    max_prompts_per_request: int = 256
    max_chat_messages: int = 1024
    # Open connections served; past it only /health is answered.
    max_connections: int = 1000
    # Seconds a client has to send a request's headers (from connecting or from its last
    # response) and, separately, its body.
    read_timeout_s: float = 30.0
    # Seconds an idle keep-alive connection stays open.
    keep_alive_timeout_s: float = 5.0
    # Seconds a stream's output may wait unread before the request is aborted.
    stream_timeout_s: float = 60.0
    # Host header values accepted (None: any). "*" accepts any.
    allowed_hosts: list[str] | None = None
    # Threads that tokenize and apply chat templates, off the event loop.
    tokenizer_threads: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or \
                not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        for name in ("max_n", "max_logprobs", "max_request_bytes", "max_prompts_per_request",
                     "max_chat_messages", "max_connections", "tokenizer_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("read_timeout_s", "keep_alive_timeout_s", "stream_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.api_key is not None:
            if not self.api_key:
                raise ValueError("api_key must not be empty (leave it unset for no key)")
            if self.api_key != self.api_key.strip():
                raise ValueError("api_key must not start or end with whitespace (a copy-paste "
                                 "slip: clients would send it trimmed)")
            if any(not 0x21 <= ord(c) <= 0x7e for c in self.api_key):
                raise ValueError("api_key must be printable ASCII without spaces")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        for name in ("drain_timeout_s", "batching_delay_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.allowed_hosts is not None:
            hosts = [h.strip() for h in self.allowed_hosts if h.strip()]
            if not hosts:
                raise ValueError("allowed_hosts must name at least one host")
            self.allowed_hosts = hosts

    @property
    def limits(self) -> ServingLimits:
        return ServingLimits(max_n=self.max_n, max_logprobs=self.max_logprobs,
                             max_prompts_per_request=self.max_prompts_per_request,
                             max_chat_messages=self.max_chat_messages)


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (scheme case-insensitive, RFC 7235; the
    key compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = got.strip().partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)
            if not ok:
                response = JSONResponse(
                    error_body("invalid or missing API key (Authorization: Bearer <key>)",
                               "AuthenticationError", 401), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if not loc:  # the body as a whole: missing, or JSON but not an object
        if first.get("type") == "missing":
            return "the request needs a JSON body", None
        return "the body must be a JSON object", None
    # A union field (prompt, stop, content) gets one error per member, tagged by its type.
    tags = []
    for e in errors:
        eloc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if len(eloc) > 1 and eloc[0] == loc[0] and not eloc[1].isdigit() and eloc[1] not in tags:
            tags.append(eloc[1])
    if len(tags) > 1:
        return f"{loc[0]}: expected one of {', '.join(tags)}", loc[0]
    return f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}", loc[0]


def build_app(llm_engine: Any, config: ServerConfig, model_name: str | None = None) -> FastAPI:
    """The app around an LLMEngine; its lifespan starts and stops the engine thread."""
    served = (config.served_model_name or model_name
              or default_served_name(llm_engine.config.model_config.model))
    metrics = Metrics(served)
    engine = AsyncLLMEngine(llm_engine, metrics, stream_timeout=config.stream_timeout_s,
                            batching_delay=config.batching_delay_ms / 1000)
    limits = config.limits
    tokenizers = TokenizerPool(llm_engine.tokenizer, config.tokenizer_threads)
    completion = OpenAIServingCompletion(engine, served, limits, tokenizers)
    chat = OpenAIServingChat(engine, served, limits, tokenizers)
    tokenization = OpenAIServingTokenization(engine, served, limits, tokenizers)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger.info("serving %r", served)
        try:
            yield
        finally:
            engine.shutdown()
            tokenizers.shutdown()

    app = FastAPI(title="vllm_lite", version=vllm_lite.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.served_model = served
    # Set when the server starts stopping: /health turns 503 so load balancers that probe
    # it stop sending while the in-flight requests finish.
    app.state.draining = False
    # Added innermost first: a request meets the Host check, then the key, then the body
    # limit, then the app.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes,
                       read_timeout=config.read_timeout_s)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=config.allowed_hosts)

    # -- errors --------------------------------------------------------------------------------
    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return JSONResponse(error_body(msg, "BadRequestError", 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = _ERROR_TYPES.get(exc.status_code, "Error")
        return JSONResponse(error_body(str(exc.detail), err_type, exc.status_code),
                            status_code=exc.status_code)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        logger.error("request failed in the engine: %s", exc)
        return JSONResponse(error_body(str(exc), "InternalServerError", 500), status_code=500)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return JSONResponse(error_body(f"internal error: {exc!r}", "InternalServerError", 500),
                            status_code=500)

    # -- endpoints -----------------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        ok = engine.is_running and not app.state.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        # vLLM's load probe: requests in the engine now (routers balance on it).
        return JSONResponse({"load": engine.num_requests})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": vllm_lite.__version__})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        # root is the served name too: never a path on this machine.
        card = ModelCard(id=served, root=served, max_model_len=completion.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenizers.run(tokenization.tokenize, req)).model_dump())

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenizers.run(tokenization.detokenize, req)).model_dump())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        # Checks, tokenization and templating run on the tokenizer threads: a huge prompt
        # must not stall the event loop (and every other client with it).
        prompts, params = await tokenizers.run(completion.prepare, req)
        if req.stream:
            return SSEResponse(sse_stream(completion.stream(req, prompts, params)),
                               send_timeout=config.stream_timeout_s)
        result = await run_unless_disconnected(raw, completion.complete(req, prompts, params))
        return JSONResponse(result.model_dump() if result is not None else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        text, ids, params = await tokenizers.run(chat.prepare, req)
        if req.stream:
            return SSEResponse(sse_stream(chat.stream(req, text, ids, params)),
                               send_timeout=config.stream_timeout_s)
        result = await run_unless_disconnected(raw, chat.complete(req, text, ids, params))
        return JSONResponse(result.model_dump() if result is not None else None)

    return app


def default_served_name(model: str) -> str:
    """The name /v1/models shows when none is given: an alias as is, a path's last part
    (a folder's name, a .gguf file's stem), never the whole local path."""
    from pathlib import Path

    p = Path(model)
    if len(p.parts) <= 1 and not model.endswith(".gguf"):
        return model
    return p.stem if p.suffix == ".gguf" else (p.name or model)


def _raise_fd_limit(config: ServerConfig) -> int:
    """Lifts the soft open-file limit to the hard one and keeps max_connections under it
    (each connection holds a descriptor; running out would refuse every client)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    # Room for model files, logs, the tokenizer, and connections past the cap (answered
    # /health-only and closed within 2 s).
    room = max(soft // 2 - 64, 16)
    if config.max_connections > room:
        logger.warning("max_connections %d does not fit the open-file limit %d; using %d",
                       config.max_connections, soft, room)
        return room
    return config.max_connections


def uvicorn_config(app: FastAPI, config: ServerConfig, **kw: Any) -> Any:
    """The uvicorn.Config that enforces the server's connection limits (used by serve()
    and by anything embedding the app in its own uvicorn.Server)."""
    import uvicorn

    max_connections = _raise_fd_limit(config)
    kw.setdefault("log_level", config.log_level)
    uv = uvicorn.Config(
        app, host=config.host, port=config.port,
        timeout_graceful_shutdown=config.drain_timeout_s,
        timeout_keep_alive=config.keep_alive_timeout_s,
        http=guarded_h11_protocol(max_connections, config.read_timeout_s),
        **kw)
    return uv


def draining_server(app: FastAPI, uv_config: Any) -> Any:
    """A uvicorn.Server that drains when stopped (SIGTERM, Ctrl-C): it closes its listening
    sockets (a load balancer's new connections are refused and go to another replica),
    turns /health to 503, lets the in-flight requests finish within the drain timeout
    (uvicorn's graceful shutdown), cuts off what is left, then stops the engine. A second
    Ctrl-C exits at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app.state.draining = True
            logger.info("draining: %d request(s) in flight, waiting up to %g s for them",
                        len(self.server_state.tasks), self.config.timeout_graceful_shutdown)
            await super().shutdown(sockets)
            logger.info("drained; stopping the engine")

    return DrainingServer(uv_config)


def serve(llm_engine: Any, config: ServerConfig, model_name: str | None = None) -> None:
    """Runs the server until interrupted (Ctrl-C / SIGTERM: it drains, then exits)."""
    app = build_app(llm_engine, config, model_name)
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s: reachable from other machines%s", config.host,
                       "" if config.api_key else ", and without an API key")
    uv_config = uvicorn_config(app, config)
    # Config() configured logging: while the server runs, every handler drops repeats
    # beyond a few a second (a client flooding bad requests cannot flood the log).
    rate_limit = RateLimitFilter()
    install_rate_limit(rate_limit)
    try:
        draining_server(app, uv_config).run()
    finally:
        remove_rate_limit(rate_limit)
