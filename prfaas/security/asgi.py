"""Peer identities on the HTTP control plane, and the role guard in front of an app.

``tls_protocol(ctx, on_refused)`` is the uvicorn protocol of a TLS listener: uvicorn hands it the plain TCP
connection and it runs the handshake itself (``loop.start_tls``), so a failed handshake is known with the peer's
address: a plaintext client (its first byte peeked) is answered ``403 KV_UNAUTHORIZED`` in plaintext; a missing,
expired, revoked or untrusted certificate ends the connection (asyncio sends no TLS alert, so the client only sees
it close); each one goes to ``on_refused`` (the audit log) with the reason in the log line. After the
handshake it records the connection's verified peer by its client address (``PEERS``) for as long as the
connection lives, since uvicorn does not put the client certificate into the ASGI scope; ``RoleGuard`` looks it up
by ``scope["client"]`` and applies ``policy.authorize``. A refusal is answered 403 with ``KV_UNAUTHORIZED`` in the
OpenAI error body, logged with the peer identity and handed to ``on_refused`` before the app sees the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from prfaas.errors import KVUnauthorized
from prfaas.security.identity import Peer, peer_from_cert
from prfaas.security.policy import authorize
from prfaas.security.refusals import PLAINTEXT, handshake_reason, refused
from prfaas.tls import TLS_HANDSHAKE, first_byte

log = logging.getLogger("prfaas.security")
PEERS: dict[tuple[str, int], Peer] = {}
OnRefused = Callable[[Peer, str, str], None]  # (peer, operation, message)


class PeerH11Protocol(H11Protocol):
    """uvicorn's h11 protocol behind our own TLS handshake (see the module docstring); ``tls_protocol`` makes the
    subclass that knows the context and where refusals go."""

    ssl_context: ssl.SSLContext | None = None
    on_refused: OnRefused | None = None
    handshake_timeout_s = 10.0
    _handshake: asyncio.Task[None] | None = None
    _connected = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._early: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        if self.ssl_context is None or transport.get_extra_info("sslcontext") is not None:
            return self._made(transport)
        transport.pause_reading()  # nothing is read as HTTP before the handshake
        self._handshake = self.loop.create_task(self._secure(transport))

    def data_received(self, data: bytes) -> None:
        if not self._connected:  # the request that arrived with the handshake's end, before start_tls returned
            self._early.append(data)
            return
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._connected:  # the peer left, or a read timeout closed it, during our handshake: uvicorn
            if self._handshake is not None:  # never saw the connection; the first-byte wait must not hold it
                self._handshake.cancel()
            return
        if self.client:
            PEERS.pop((str(self.client[0]), int(self.client[1])), None)
        super().connection_lost(exc)

    def _made(self, transport: Any) -> None:
        self._connected = True
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if self.client:
            cert = ssl_object.getpeercert() if ssl_object is not None else None
            PEERS[(str(self.client[0]), int(self.client[1]))] = peer_from_cert(cert, str(self.client[0]))
        early, self._early = self._early, []
        for data in early:
            super().data_received(data)

    async def _secure(self, transport: Any) -> None:
        assert self.ssl_context is not None
        peer = Peer(None, "", str((transport.get_extra_info("peername") or ("",))[0]))
        try:
            first = await _first_byte(transport)
            if not first:
                transport.close()  # closed without a word (a port check): nothing to refuse
                return
            if first != TLS_HANDSHAKE:
                self._refuse(peer, PLAINTEXT)
                body = json.dumps(_error_body(KVUnauthorized("this server accepts TLS 1.3 only"))).encode()
                transport.write(b"HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\nconnection: close\r\n"
                                b"content-length: %d\r\n\r\n%s" % (len(body), body))
                transport.close()
                return
            secured = await self.loop.start_tls(transport, self, self.ssl_context, server_side=True,
                                                ssl_handshake_timeout=self.handshake_timeout_s)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            self._refuse(peer, handshake_reason(exc))
            transport.close()
            return
        if secured is None or secured.is_closing():
            return
        self._made(secured)

    def _refuse(self, peer: Peer, reason: str) -> None:
        refused(None, peer, "tls", reason)  # the log line; on_refused records it
        on_refused = type(self).on_refused
        if on_refused is not None:
            on_refused(peer, "tls", reason)


def tls_protocol(ctx: ssl.SSLContext, on_refused: OnRefused | None = None) -> type[PeerH11Protocol]:
    """The uvicorn ``http`` protocol class for a TLS listener with ``ctx``; handshake refusals go to
    ``on_refused``."""
    return type("TLSPeerH11Protocol", (PeerH11Protocol,), {"ssl_context": ctx, "on_refused": on_refused})


async def _first_byte(transport: Any) -> bytes:
    sock = transport.get_extra_info("socket").dup()  # asyncio's socket wrapper cannot peek; its duplicate can
    try:
        async with asyncio.timeout(PeerH11Protocol.handshake_timeout_s):
            return await first_byte(sock)
    finally:
        sock.close()


def peer_of(scope: dict[str, Any]) -> Peer:
    client = scope.get("client") or ("", 0)
    return PEERS.get((str(client[0]), int(client[1])), Peer(None, "", str(client[0])))


class RoleGuard:
    """ASGI middleware: requests whose path starts with a rule's prefix need that rule's operation. With
    ``required`` (the role's ``tls.required``) a peer without a certificate is refused too."""

    def __init__(self, app: Any, rules: Sequence[tuple[str, str]], on_refused: OnRefused | None = None,
                 required: bool = True) -> None:
        self.app, self.rules, self.on_refused, self.required = app, rules, on_refused, required

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        operation = self._operation(scope)
        if operation is None:
            return await self.app(scope, receive, send)
        peer = peer_of(scope)
        try:
            if peer.name or self.required:  # no certificate is let through only while TLS is optional
                authorize(peer.role, operation)
        except KVUnauthorized as exc:
            log.warning("refused %s %s to %s: %s", operation, scope.get("path"), peer.identity, exc.message)
            if self.on_refused is not None:
                self.on_refused(peer, operation, exc.message)
            return await _forbidden(send, exc)
        await self.app(scope, receive, send)

    def _operation(self, scope: dict[str, Any]) -> str | None:
        if scope["type"] != "http":
            return None
        path = str(scope.get("path", ""))
        return next((op for prefix, op in self.rules if path.startswith(prefix)), None)


def _error_body(exc: KVUnauthorized) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": "permission_error", "code": exc.code, "param": None}}


async def _forbidden(send: Any, exc: KVUnauthorized) -> None:
    body = json.dumps(_error_body(exc)).encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

