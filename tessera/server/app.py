"""``create_app``: the FastAPI application of ``tessera serve`` (OpenAI-compatible endpoints over one engine).

Hardening lives here: the API key, the request body limit, OpenAI-style error bodies for every failure (FastAPI's
422 validation answers become 400), and the lifespan that starts the engine loop and stops it cleanly.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.engine import LLM
from tessera.server import protocol as p
from tessera.server.bridge import ClientGone
from tessera.server.engine_loop import EngineLoop
from tessera.server.metrics import ServerMetrics
from tessera.server.openai_api import ServerSettings, chat_completions, completions
from tessera.server.validation import validation_error

log = logging.getLogger("tessera.server")
DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: Routes counted by name in ``tessera_http_requests_total``; anything else counts as "other" (bounded labels).
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def create_app(llm: LLM, model_name: str, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_tokens_limit: int | None = None,
               shutdown_llm: bool = False) -> FastAPI:
    """The server application over ``llm``; the engine loop starts with the app's lifespan and stops with it.

    Parameters
    ----------
    llm : the engine; once the app has started only its loop thread touches it.
    model_name : the id ``/v1/models`` reports and requests must name (or omit).
    api_key : when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>`` (401 otherwise); None serves
        without one. An empty key is refused (ValueError): it would match a request with no key at all.
    max_queue : requests (choices) that may wait for a slot in the running batch; a request that would make more
        wait gets 503.
    max_body_bytes : larger request bodies get 413.
    max_tokens_limit : largest ``max_tokens`` a request may ask for (400 above). Default and upper bound: what one
        sequence can hold after a 1-token prompt, ``llm.max_seq_tokens - 1`` (the context or the whole KV cache,
        whichever is smaller), so that no ``max_tokens`` under the limit is refused for the cache's size alone.
    shutdown_llm : also call ``llm.shutdown()`` when the app stops, after the engine loop: a tensor-parallel
        engine's worker ranks then stop with the server. For an app that owns its engine (``tessera serve`` passes
        True); the default leaves ``llm`` to its caller.

    Raises
    ------
    ValueError
        An empty ``api_key``, or a ``max_tokens_limit`` below 1 or above what one sequence can hold.

    Notes
    -----
    Run the app with :class:`tessera.server.GracefulServer` (as ``tessera serve`` does) so that a shutdown ends
    each open request with an error chunk or a 503 at the graceful timeout; a plain ASGI server cancels the
    handlers instead, which cuts their connections.

    Examples
    --------
    >>> app = create_app(LLM(), "SmolLM2-135M-Instruct", api_key="secret")
    >>> import uvicorn; uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
    """
    if api_key is not None and not api_key.strip():
        raise ValueError(f"the API key is empty ({api_key!r}): it would let in requests that send no key; pass a "
                         "non-empty key (e.g. `openssl rand -hex 16`), or none to serve without authentication")
    metrics = ServerMetrics()
    engine = EngineLoop(llm, metrics, max_queue)
    settings = ServerSettings(engine, model_name, tokens_limit(llm, max_tokens_limit), llm.model.chat_template)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:  # uvicorn has stopped accepting and waited for open requests (up to its graceful timeout)
            engine.shutdown()
            if shutdown_llm:
                # here, not after server.run() returns: on SIGTERM uvicorn re-raises the signal once it has stopped,
                # which ends the process before any code after run() could stop the workers gracefully
                llm.shutdown()

    app = FastAPI(title="tessera", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings
    _add_error_handlers(app)
    _add_routes(app, settings, metrics)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)
    return app


def tokens_limit(llm: LLM, wanted: int | None) -> int:
    """The server's ``max_tokens`` limit: ``wanted``, or by default the most one sequence can generate after a
    1-token prompt (``llm.max_seq_tokens - 1``), which is also the most ``wanted`` may be."""
    most = llm.max_seq_tokens - 1
    if wanted is None:
        return most
    if wanted < 1 or wanted > most:
        bm = llm.block_manager
        raise ValueError(f"max_tokens_limit must be in [1, {most}], got {wanted}: one sequence holds "
                         f"{llm.max_seq_tokens} tokens (the context is {llm.max_len}, the KV cache "
                         f"{bm.num_pages} pages of {bm.page_size}) and a prompt takes at least one; lower the "
                         "limit, or give the KV cache more memory (--kv-cache-memory-mib, --num-pages)")
    return wanted


def _add_routes(app: FastAPI, settings: ServerSettings, metrics: ServerMetrics) -> None:
    created = p.now()

    @app.post("/v1/completions")
    async def _completions(body: p.CompletionRequest, request: Request) -> Any:
        return await completions(settings, body, request)

    @app.post("/v1/chat/completions")
    async def _chat(body: p.ChatCompletionRequest, request: Request) -> Any:
        return await chat_completions(settings, body, request)

    @app.get("/v1/models")
    async def _models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=settings.model_name, created=created)])

    @app.get("/health")
    async def _health() -> Response:
        alive = settings.engine.is_alive
        return JSONResponse({"status": "ok" if alive else "engine loop not running"}, status_code=200 if alive
                            else 503)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return PlainTextResponse(metrics.render(settings.engine.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


def _error(err: p.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(p.APIError)
    async def _api_error(_: Request, err: p.APIError) -> Response:
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> Response:
        # OpenAI answers malformed bodies with 400 and names the parameter; FastAPI's default is 422 with a list.
        return _error(validation_error(err.errors()))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, err: HTTPException) -> Response:
        code = {404: "not_found", 413: "request_too_large"}.get(err.status_code)
        return _error(p.APIError(err.status_code, str(err.detail), code=code))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> Response:
        log.exception("unhandled error", exc_info=err)
        return _error(p.APIError(500, f"Internal server error: {type(err).__name__}", type="server_error"))

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it


class BodyTooLarge(HTTPException):
    """Raised while the body streams in; an HTTPException so FastAPI's body parsing passes it through as is."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than this server accepts ({limit} bytes; "
                              "--max-body-bytes)")


class Guard:
    """Pure ASGI middleware: API key check on ``/v1/*``, request body limit, and per-route request counting.

    The body limit is enforced on ``Content-Length`` up front and again while the body streams in (a chunked body
    has no length), so a client can never make the server buffer more than ``max_body_bytes``.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics) -> None:
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            error = self._refuse(scope)
            if error is not None:
                await _error(error)(scope, receive, counting_send)
                return
            await self._call_limited(scope, receive, counting_send)
        finally:
            self.metrics.inc("http_requests_total", endpoint=path if path in ROUTES else "other",
                             status=str(status["code"]))

    def _refuse(self, scope: Scope) -> p.APIError | None:
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):  # constant time: no guessing the key byte by byte
                return p.APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return self._too_large()
        return None

    def _too_large(self) -> p.APIError:
        return p.APIError(413, BodyTooLarge(self.max_body_bytes).detail, code="request_too_large")

    async def _call_limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen, started = 0, False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:  # raised outside FastAPI's body parsing
            if not started:
                await _error(self._too_large())(scope, receive, send)

