"""Read timeouts (``prfaas.security.readtimeout``) on the TLS listener too: behind mutual TLS a trickled head or
body is answered 408 inside the TLS session and closed, a peer that never starts its handshake is closed, and a
normal request on the same server is unaffected. Also: the limits that configure them are checked at load."""

from __future__ import annotations

import asyncio
import ssl
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from prfaas import tls
from prfaas.config import load_config
from prfaas.errors import InvalidRequest
from prfaas.limits import WireLimits
from prfaas.security import guards
from prfaas.security.runtime import Security
from prfaas.services import http, jsonbody
from tests.security.conftest import tls_config

TIMEOUTS = WireLimits(header_timeout_ms=500, body_timeout_ms=1000)


def app_reading_bodies(security: Security) -> FastAPI:
    app = FastAPI()
    http.install_error_handlers(app)

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        return {"got": await jsonbody.read(request)}

    guards.protect_instance(app, security=security)
    return app


async def trickle(port: int, ctx: ssl.SSLContext | None, first: bytes, every_s: float = 0.1,
                  for_s: float = 5.0) -> tuple[float, bytes]:
    """Open a connection (TLS with ``ctx``), send ``first``, then a byte every ``every_s`` until the server closes;
    (seconds until it closed, what it sent)."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                                   server_hostname="localhost" if ctx else None)
    received = b""
    try:
        writer.write(first)
        while time.monotonic() - started < for_s and not reader.at_eof():
            if first:
                writer.write(b"y")
            try:
                received += await asyncio.wait_for(reader.read(4096), every_s)
            except TimeoutError:
                continue
    except (OSError, ssl.SSLError):
        pass
    finally:
        writer.close()
    return time.monotonic() - started, received


def test_trickled_requests_are_closed_behind_tls(pki: Path, as_role: Any) -> None:
    security = as_role("decode").security
    router = tls.client_context(tls_config(pki, "router"))

    async def scenario() -> list[tuple[float, bytes]]:
        sock = http.bind("127.0.0.1", 0)
        port = sock.getsockname()[1]
        task = asyncio.create_task(http.serve(app_reading_bodies(security), sock, ssl=security.server_ssl(),
                                              limits=TIMEOUTS))
        try:
            async with httpx.AsyncClient(verify=router, timeout=5.0) as c:
                for _ in range(100):
                    try:
                        reply = await c.post(f"https://127.0.0.1:{port}/generate", json={"a": 1})
                        break
                    except httpx.HTTPError:
                        await asyncio.sleep(0.05)
                assert reply.status_code == 200 and reply.json() == {"got": {"a": 1}}
            head = b"POST /generate HTTP/1.1\r\nhost: x\r\nx-padding: "
            body = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"
            return list(await asyncio.gather(trickle(port, router, head), trickle(port, router, body),
                                             trickle(port, None, b"")))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sock.close()

    (head_s, head), (body_s, body), (silent_s, silent) = asyncio.run(scenario())
    assert head.startswith(b"HTTP/1.1 408 ") and b"REQUEST_TIMEOUT" in head and head_s < 2.0, (head_s, head[:80])
    assert body.startswith(b"HTTP/1.1 408 ") and b"request body" in body and body_s < 2.5, (body_s, body[:80])
    assert silent == b"" and silent_s < 2.0


@pytest.mark.parametrize(("text", "words"), [
    ("limits: {header_timeout_ms: 0}", "limits.header_timeout_ms must be a positive integer"),
    ("limits: {body_timeout_ms: 50}", "limits.body_timeout_ms must be at least 100"),
    ("limits: {max_json_depth: 1000}", "limits.max_json_depth must be within 4–512"),
])
def test_bad_http_limits_are_refused_at_load(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(InvalidRequest, match=words):
        load_config(path)
