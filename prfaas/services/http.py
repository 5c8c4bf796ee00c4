"""Shared HTTP plumbing: uvicorn on a pre-bound socket (port 0 works), OpenAI-style errors, NDJSON streams.

Every answer of every role's app is either its route's own or an OpenAI error body
``{"error": {"message", "type", "code", "param"}}`` whose ``code`` is never null: ``install_error_handlers``
renders prfaas errors, unknown routes (404), wrong methods (405) and anything unexpected (500); ``ErrorBoundary``,
the outermost layer ``serve`` puts around the app, logs each unexpected exception once with its traceback and
answers 500 for one raised outside the app's own handlers (a middleware). Request bodies become JSON in one place,
``prfaas.services.jsonbody``; the server's read timeouts are ``prfaas.security.readtimeout``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_module
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException

from prfaas.errors import InvalidRequest, PrfaasError
from prfaas.events import Event, Failed
from prfaas.limits import WireLimits
from prfaas.obs import metrics

# OpenAI's `type` per status (it answers an unknown model or URL with a 404 of type invalid_request_error).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
                409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error"}
# The body's `code` where no prfaas error is at hand: OpenAI's `unknown_url` for a route that does not exist,
# else a prfaas code by status, so that no error body has a null code.
UNKNOWN_URL = "unknown_url"
_STATUS_CODES = {400: InvalidRequest.code, 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 500: "INTERNAL_ERROR"}
log = logging.getLogger("prfaas.http")
T = TypeVar("T")


def setup_logging(name: str) -> None:
    """One line per event, tagged with the process's role; per-request client chatter stays out."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; with port 0 the kernel picks a free port (read it with ``getsockname``).

    Its protocol is named (``IPPROTO_TCP``, not 0) because asyncio sets ``TCP_NODELAY`` only on accepted sockets
    whose protocol says TCP: without it every response written in two pieces (headers, then a body or a stream's
    first event) waited for the peer's delayed ACK, about 40 ms on each keep-alive request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body; without ``code``, the status's own (``_STATUS_CODES``)."""
    kind = _ERROR_TYPES.get(status, "server_error")
    code = code or _STATUS_CODES.get(status, _STATUS_CODES[500])
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def error_response(exc: PrfaasError) -> JSONResponse:
    retry_after = getattr(exc, "retry_after_s", 1)
    headers = {"Retry-After": str(retry_after)} if exc.retryable and exc.http_status in (429, 503) else None
    return JSONResponse(error_body(exc.http_status, exc.message, exc.code, getattr(exc, "param", None)),
                        status_code=exc.http_status,
                        headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PrfaasError)
    async def _prfaas(request: Request, exc: PrfaasError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)  # routing's 404 and 405, in the OpenAI shape rather than {"detail"}
    async def _routing(request: Request, exc: HTTPException) -> JSONResponse:
        message = _ROUTING.get(exc.status_code, "{detail}").format(
            method=request.method, path=request.url.path, detail=exc.detail)
        code = UNKNOWN_URL if exc.status_code == 404 else None
        return JSONResponse(error_body(exc.status_code, message, code), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, f"invalid request: {exc.errors()}", None), status_code=400)

    @app.exception_handler(Exception)  # ServerErrorMiddleware's: it re-raises to ErrorBoundary, which logs it
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, _INTERNAL, None), status_code=500)


def install_metrics(app: FastAPI, registries: tuple[CollectorRegistry, ...]) -> None:
    """``GET /metrics``: the series of the components this process runs (``prfaas.obs.metrics.served``)."""
    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(metrics.render(registries), media_type="text/plain; version=0.0.4")


_ROUTING = {404: "Invalid URL ({method} {path})", 405: "Method {method} is not allowed on {path}"}
_INTERNAL = "the server had an error while processing your request"


class ErrorBoundary:
    """The outermost ASGI layer of every prfaas app (see the module docstring). An exception after the reply began
    cannot change its status: it is logged and the reply left incomplete, so uvicorn closes the connection and
    the peer sees a truncated stream rather than a clean end."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await JSONResponse(error_body(500, _INTERNAL, None), status_code=500)(scope, receive, send)


def ndjson(events: AsyncIterator[Event]) -> StreamingResponse:
    """A stream of events (``prfaas.events``, one NDJSON line each); one that fails unexpectedly ends with a
    ``Failed`` event (logged with its traceback) instead of a cut connection, since its 200 status is already
    sent."""
    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event.encode()
        except Exception:
            log.exception("unexpected error in a stream")
            yield Failed.of(PrfaasError(_INTERNAL)).encode()

    return StreamingResponse(body(), media_type="application/x-ndjson")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a role's process on uvloop's event loop, as vLLM's and SGLang's API servers run (a dependency wherever
    it installs: every platform but Windows), else on asyncio's. Each token crosses two HTTP hops, the decode
    instance's and the router's, so the loop's cost per read and write is paid per token."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def serve(app: FastAPI, sock: socket.socket, on_started: Callable[[], Awaitable[None]] | None = None,
                ssl: ssl_module.SSLContext | None = None,
                server_class: type[uvicorn.Server] = uvicorn.Server, limits: WireLimits | None = None) -> None:
    """Run ``app`` on ``sock`` until SIGINT/SIGTERM; uvicorn drains open requests before lifespan shutdown.
    With ``ssl`` it serves TLS only (``prfaas.security.asgi.tls_protocol``: a plaintext peer is refused before
    any request is read, each refusal goes to ``app.state.tls_refused``) and records each peer's certificate for
    ``prfaas.security.asgi.RoleGuard``. A request head or body slower than the configured read timeouts is
    answered 408 and its connection closed (``prfaas.security.readtimeout``). ``limits`` (default: the app's,
    ``app.state.limits``, else the defaults) give those timeouts and the largest request head."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from prfaas.security.guards import limits_of
    from prfaas.security.readtimeout import timed

    limits = limits or limits_of(app)

    protocol: type[H11Protocol] = H11Protocol
    if ssl is not None:
        from prfaas.security.asgi import tls_protocol

        protocol = tls_protocol(ssl, getattr(app.state, "tls_refused", None))
    extra: dict[str, Any] = {"http": timed(protocol, limits),
                             "h11_max_incomplete_event_size": limits.max_header_bytes}
    config = uvicorn.Config(ErrorBoundary(app), log_level="warning", lifespan="on", timeout_graceful_shutdown=10,
                            **extra)
    server = server_class(config)  # prfaas.services.drain: SIGTERM drains an instance
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if on_started and server.started:
        await on_started()
    await task
