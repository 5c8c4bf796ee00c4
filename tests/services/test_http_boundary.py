"""The error boundary of every prfaas HTTP app (``prfaas.services.http``), on a real server and socket: an
exception in a route or in a middleware is a 500 in the OpenAI error body (not uvicorn's plain text), logged once
with its traceback; a stream that fails after its 200 ends with an ``error`` event; the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from prfaas.events import Event, Token
from prfaas.services import http


class Exploding:
    """A middleware with a bug on ``/mw``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/mw":
            raise RuntimeError("a middleware bug")
        await self.app(scope, receive, send)


def buggy_app() -> FastAPI:
    app = FastAPI()
    http.install_error_handlers(app)

    @app.get("/route")
    async def route() -> dict[str, Any]:
        raise KeyError("a route bug")

    @app.get("/stream")
    async def stream() -> Any:
        async def events() -> AsyncIterator[Event]:
            yield Token(token=1, text="a")
            raise ValueError("a stream bug")

        return http.ndjson(events())

    @app.get("/ok")
    async def ok() -> dict[str, Any]:
        return {"ok": True}

    app.add_middleware(Exploding)
    return app


def test_unexpected_errors_are_openai_500s_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)

    async def scenario() -> dict[str, httpx.Response]:
        sock = http.bind("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        task = asyncio.create_task(http.serve(buggy_app(), sock))
        try:
            async with httpx.AsyncClient(base_url=url, timeout=5.0) as c:
                for _ in range(100):
                    try:
                        await c.get("/ok")
                        break
                    except httpx.HTTPError:
                        await asyncio.sleep(0.05)
                return {path: await c.get(path) for path in ("/route", "/mw", "/stream", "/ok")}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sock.close()

    replies = asyncio.run(scenario())
    for path in ("/route", "/mw"):
        assert replies[path].status_code == 500, replies[path].text
        error = replies[path].json()["error"]
        assert error["type"] == "server_error" and set(error) == {"message", "type", "code", "param"}
        assert "bug" not in error["message"]  # internals stay in the log
    events = [json.loads(line) for line in replies["/stream"].text.splitlines()]
    assert replies["/stream"].status_code == 200 and events[-1]["event"] == "error"
    assert replies["/ok"].json() == {"ok": True}
    logged = [r for r in caplog.records if r.exc_info]
    assert sorted(str(r.exc_info[1]) for r in logged if r.exc_info) == ["'a route bug'", "a middleware bug",
                                                                        "a stream bug"]
    assert not any("Exception in ASGI application" in r.getMessage() for r in caplog.records)


def test_served_connections_send_without_waiting_for_the_peers_ack() -> None:
    """Every prfaas server listens on ``http.bind``'s socket; asyncio sets ``TCP_NODELAY`` on a connection it
    accepts only where that socket's protocol says TCP. Without it a response written in two pieces (headers, then
    the body or a stream's first event) waited for the peer's delayed ACK: about 40 ms per keep-alive request."""

    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await loop.create_server(Probe, sock=http.bind("127.0.0.1", 0))  # as uvicorn serves it
        async with server:
            _, writer = await asyncio.open_connection(*server.sockets[0].getsockname())
            try:
                return await asyncio.wait_for(accepted, 5)
            finally:
                writer.close()

    assert asyncio.run(scenario()) != 0
