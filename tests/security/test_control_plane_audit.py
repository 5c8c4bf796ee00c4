"""Control-plane refusals on the router and on a decode instance (no store of its own) go to the process's own
audit log with the peer identity, never the key: a missing or invalid API key (401), a wrong role (403), a
plaintext client (403 ``KV_UNAUTHORIZED``), an expired certificate and one from another CA (TLS alert)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from prfaas import tls
from prfaas.audit import verify
from prfaas.audit.chain import read_entries
from prfaas.errors import KVUnauthorized
from prfaas.security import certs, guards, local
from prfaas.services import http
from tests.security.conftest import tls_config

KEY = "sk-test-0123456789abcdef"


@contextlib.asynccontextmanager
async def serving(app: FastAPI, ctx: ssl.SSLContext | None) -> AsyncIterator[str]:
    """``app`` on a free port over TLS until the block ends, then a graceful shutdown (lifespan included)."""
    servers: list[uvicorn.Server] = []

    class Captured(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            servers.append(self)

    sock = http.bind("127.0.0.1", 0)
    url = f"https://127.0.0.1:{sock.getsockname()[1]}"
    task = asyncio.create_task(http.serve(app, sock, ssl=ctx, server_class=Captured))
    try:
        while not (servers and servers[0].started):
            await asyncio.sleep(0.02)
        yield url
    finally:
        servers[0].should_exit = True
        await asyncio.wait_for(task, 15)
        sock.close()


def client(pki: Path, name: str) -> ssl.SSLContext:
    return tls.client_context(tls_config(pki, name))


def stranger(pki: Path) -> ssl.SSLContext:
    ctx = tls.client_context(tls_config(pki / "stranger", "prefill"))
    ctx.load_verify_locations(cafile=str(pki / "ca.pem"))
    return ctx


async def post(url: str, verify: Any, path: str, headers: dict[str, str] | None = None) -> int:
    async with httpx.AsyncClient(verify=verify, timeout=5.0) as c:
        return (await c.post(f"{url}{path}", json={"instance_id": "x"}, headers=headers)).status_code


async def refused_handshake(url: str, verify: ssl.SSLContext, path: str) -> str:
    """The server ends the handshake (asyncio does not send the TLS alert): the client sees the connection
    close before any HTTP reply; the reason is in the server's log and the refusal in its audit log."""
    with pytest.raises(httpx.TransportError):
        await post(url, verify, path)
    return "closed"


def refusals(path: Path) -> list[tuple[str, str]]:
    return [(e["action"], e["who"]) for _, e, _ in read_entries(path)
            if e and e.get("kind") == "access" and e.get("outcome") == KVUnauthorized.code]


def test_router_refusals_are_audited(pki: Path, as_role: Any, tmp_path: Path) -> None:
    from prfaas.services.router import Router, create_app

    audit = tmp_path / "audit-{instance}.log"
    config, security = as_role("router", audit_log=str(audit), api_keys=({"name": "team-a", "key": KEY},))
    ca = local.ca_client_context(str(pki / "ca.pem"))

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        app = create_app(Router(config, security=security))
        async with serving(app, security.server_ssl(client_certs=False)) as url:
            out["no key"] = await post(url, ca, "/v1/completions")
            out["bad key"] = await post(url, ca, "/v1/completions", {"Authorization": "Bearer sk-wrong-0123456789"})
            out["good key"] = await post(url, ca, "/v1/completions", {"Authorization": f"Bearer {KEY}"})
            out["router registers"] = await post(url, client(pki, "router"), "/internal/deregister")
            out["decode registers"] = await post(url, client(pki, "decode"), "/internal/deregister")
            async with httpx.AsyncClient(timeout=5.0) as c:
                plain = await c.get(url.replace("https", "http") + "/v1/models")
            out["plaintext"] = (plain.status_code, plain.json()["error"]["code"])
            out["expired"] = await refused_handshake(url, client(pki, "decode-old"), "/internal/heartbeat")
            out["wrong CA"] = await refused_handshake(url, stranger(pki), "/internal/heartbeat")
        return out

    out = asyncio.run(scenario())
    assert (out["no key"], out["bad key"], out["router registers"], out["decode registers"]) == (401, 401, 403, 200)
    assert out["good key"] == 400  # past the key: the empty completion request is refused as invalid
    assert out["plaintext"] == (403, KVUnauthorized.code) and out["expired"] == out["wrong CA"] == "closed"
    log = Path(str(audit).replace("{instance}", "router"))
    assert refusals(log) == [("api_key", "127.0.0.1"), ("api_key", "127.0.0.1"),
                             ("register", "router/router@127.0.0.1"), ("tls", "127.0.0.1"),
                             ("tls", "127.0.0.1"), ("tls", "127.0.0.1")]
    assert KEY not in log.read_text() and "sk-wrong" not in log.read_text()
    verdict = verify(log)
    assert verdict.ok and verdict.clean_close


def test_decode_refusals_are_audited(pki: Path, as_role: Any, tmp_path: Path) -> None:
    """A decode instance has no store: its refusals go to its own audit log (``{instance}`` → its id). Its TLS
context checks the revocation list too: a revoked router certificate is refused, the others still work."""
    certs.issue(pki, "router", "router-stolen")
    audit = tmp_path / "audit-{instance}.log"
    config, security = as_role("decode", crl=str(certs.revoke(pki, "router-stolen")), audit_log=str(audit))
    seen: list[str] = []
    app = FastAPI()

    @app.post("/generate")
    async def generate() -> dict[str, Any]:
        seen.append("generate")
        return {"ok": True}

    guards.protect_instance(app, None, config, "decode-7", security)

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with serving(app, security.server_ssl()) as url:
            out["router"] = await post(url, client(pki, "router"), "/generate")
            out["prefill"] = await post(url, client(pki, "prefill"), "/generate")
            async with httpx.AsyncClient(timeout=5.0) as c:
                out["plaintext"] = (await c.post(url.replace("https", "http") + "/generate")).status_code
            out["no certificate"] = await refused_handshake(url, local.ca_client_context(str(pki / "ca.pem")),
                                                            "/generate")
            out["wrong CA"] = await refused_handshake(url, stranger(pki), "/generate")
            out["revoked"] = await refused_handshake(url, client(pki, "router-stolen"), "/generate")
        return out

    out = asyncio.run(scenario())
    assert (out["router"], out["prefill"], out["plaintext"]) == (200, 403, 403) and seen == ["generate"]
    assert out["no certificate"] == out["wrong CA"] == out["revoked"] == "closed"
    log = Path(str(audit).replace("{instance}", "decode-7"))
    assert refusals(log) == [("assign", "prefill/prefill@127.0.0.1")] + [("tls", "127.0.0.1")] * 4
    assert verify(log).ok


def test_a_request_sent_with_the_handshakes_last_flight_is_served(pki: Path, as_role: Any) -> None:
    """The client's Finished and its first request arrive in one segment: the request reaches the protocol before
    the handshake call returns, and must still be served (it once crashed uvicorn's request cycle)."""
    security = as_role("decode").security
    app = FastAPI()

    @app.post("/generate")
    async def generate() -> dict[str, Any]:
        return {"ok": True}

    guards.protect_instance(app, security=security)

    async def scenario() -> bytes:
        async with serving(app, security.server_ssl()) as url:
            port = int(url.rsplit(":", 1)[1])
            incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            tls_client = client(pki, "router").wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                while True:
                    try:
                        tls_client.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        writer.write(outgoing.read())
                        incoming.write(await asyncio.wait_for(reader.read(65536), 5))
                tls_client.write(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
                writer.write(outgoing.read())  # our Finished and the request, in one write
                reply = b""
                while b"\r\n\r\n" not in reply:
                    incoming.write(await asyncio.wait_for(reader.read(65536), 5))
                    with contextlib.suppress(ssl.SSLWantReadError):
                        reply += tls_client.read(65536)
                return reply
            finally:
                writer.close()
                await writer.wait_closed()

    assert asyncio.run(scenario()).startswith(b"HTTP/1.1 200")
