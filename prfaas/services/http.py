"""Shared HTTP plumbing: uvicorn on a pre-bound socket (port 0 works), OpenAI-style errors, NDJSON streams."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl as ssl_module
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prfaas.errors import InvalidRequest, PrfaasError
from prfaas.obs import metrics

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                429: "rate_limit_error"}


def setup_logging(name: str) -> None:
    """One line per event, tagged with the process's role; per-request client chatter stays out."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; with port 0 the kernel picks a free port (read it with ``getsockname``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def error_body(status: int, message: str, code: str | None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}


def error_response(exc: PrfaasError) -> JSONResponse:
    retry_after = getattr(exc, "retry_after_s", 1)
    headers = {"Retry-After": str(retry_after)} if exc.retryable and exc.http_status in (429, 503) else None
    code = None if isinstance(exc, InvalidRequest) else exc.code
    return JSONResponse(error_body(exc.http_status, exc.message, code), status_code=exc.http_status,
                        headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PrfaasError)
    async def _prfaas(request: Request, exc: PrfaasError) -> JSONResponse:
        return error_response(exc)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")


def ndjson(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        async for event in events:
            yield (json.dumps(event) + "\n").encode()

    return StreamingResponse(body(), media_type="application/x-ndjson")


async def serve(app: FastAPI, sock: socket.socket, on_started: Callable[[], Awaitable[None]] | None = None,
                ssl: ssl_module.SSLContext | None = None,
                server_class: type[uvicorn.Server] = uvicorn.Server) -> None:
    """Run ``app`` on ``sock`` until SIGINT/SIGTERM; uvicorn drains open requests before lifespan shutdown.
    With ``ssl`` it serves TLS only (``prfaas.security.asgi.tls_protocol``: a plaintext peer is refused before
    any request is read, each refusal goes to ``app.state.tls_refused``) and records each peer's certificate for
    ``prfaas.security.asgi.RoleGuard``."""
    from prfaas.security import limits

    extra: dict[str, Any] = {"http": "h11", "h11_max_incomplete_event_size": limits.current().max_header_bytes}
    if ssl is not None:
        from prfaas.security.asgi import tls_protocol

        extra["http"] = tls_protocol(ssl, getattr(app.state, "tls_refused", None))
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=10, **extra)
    server = server_class(config)  # prfaas.services.drain: SIGTERM drains an instance
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if on_started and server.started:
        await on_started()
    await task
