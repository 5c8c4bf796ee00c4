"""The HTTP control plane under mutual TLS: only the router assigns work to instances, only instances register;
refusals are 403 KV_UNAUTHORIZED; a plaintext client is refused at the handshake, before any request is read."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from prfaas import tls
from prfaas.security import guards, local
from prfaas.services import http
from tests.security.conftest import tls_config


def ca(pki: Path) -> Any:
    return local.ca_client_context(str(pki / "ca.pem"))


def app_with(seen: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/prefill")
    async def prefill() -> dict[str, Any]:
        seen.append("prefill")
        return {"ok": True}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    return app


async def call(url: str, verify: Any, path: str = "/prefill") -> httpx.Response:
    async with httpx.AsyncClient(verify=verify, timeout=5.0) as c:
        return await c.post(f"{url}{path}", json={"x": 1})


@pytest.mark.parametrize("run", [asyncio.run, http.run], ids=["asyncio", "roles-loop"])  # the roles run on uvloop
def test_only_the_router_assigns_work(pki: Path, as_role: Any, run: Any) -> None:
    security = as_role("prefill").security
    seen: list[str] = []
    refused: list[Any] = []
    app = app_with(seen)
    guards.protect_instance(app, refused.append, security=security)

    async def scenario() -> None:
        sock = http.bind("127.0.0.1", 0)
        url = f"https://127.0.0.1:{sock.getsockname()[1]}"
        task = asyncio.create_task(http.serve(app, sock, ssl=security.server_ssl()))
        try:
            for _ in range(100):
                try:
                    await call(url, tls.client_context(tls_config(pki, "router")), "/health")
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
            assert (await call(url, tls.client_context(tls_config(pki, "router")))).status_code == 200
            reply = await call(url, tls.client_context(tls_config(pki, "decode")))
            assert reply.status_code == 403 and reply.json()["error"]["code"] == "KV_UNAUTHORIZED"
            plain = await call(url.replace("https", "http"), True)  # answered in plaintext, never read as a request
            assert plain.status_code == 403 and plain.json()["error"]["code"] == "KV_UNAUTHORIZED"
            with pytest.raises(httpx.HTTPError):  # no client certificate while required
                await call(url, ca(pki))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(scenario())
    assert seen == ["prefill"]
    assert [(r.action, r.who, r.outcome) for r in refused] == [
        ("assign", "decode/decode@127.0.0.1", "KV_UNAUTHORIZED"), ("tls", "127.0.0.1", "KV_UNAUTHORIZED"),
        ("tls", "127.0.0.1", "KV_UNAUTHORIZED")]


def test_only_instances_register(pki: Path, as_role: Any) -> None:
    from prfaas.services.router import Router, create_app

    config, security = as_role("router")

    async def scenario() -> None:
        app = create_app(Router(config, security=security))
        sock = http.bind("127.0.0.1", 0)
        url = f"https://127.0.0.1:{sock.getsockname()[1]}"
        task = asyncio.create_task(http.serve(app, sock, ssl=security.server_ssl(client_certs=False)))
        try:
            for _ in range(100):
                try:
                    await call(url, ca(pki), "/health")
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
            for role in ("router", "decode"):
                reply = await call(url, tls.client_context(tls_config(pki, role)), "/internal/deregister")
                assert reply.status_code == (403 if role == "router" else 200), role
            no_cert = await call(url, ca(pki), "/internal/deregister")  # a public client
            assert no_cert.status_code == 403
            assert (await call(url, ca(pki), "/v1/models")).status_code == 405  # public, no key needed
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
