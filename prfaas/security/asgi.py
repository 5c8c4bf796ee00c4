"""Peer identities on the HTTP control plane, and the role guard in front of an app.

``tls_protocol(ctx, on_refused)`` is the uvicorn protocol of a TLS listener: uvicorn hands it the plain TCP
connection; it takes the socket over before anything is read and runs the handshake itself
(``loop.connect_accepted_socket``: the same on asyncio's loop and on uvloop, which starts reading a connection
whatever its ``connection_made`` asked), so a failed handshake is known with the peer's address: a plaintext
client (its first byte peeked) is answered ``403 KV_UNAUTHORIZED`` in plaintext; a missing, expired, revoked or
untrusted certificate ends the connection (asyncio sends no TLS alert, so the client only sees it close); each one
goes to ``on_refused`` (the audit log) with the reason in the log line. After the handshake it records the
connection's verified peer by its client address (``PEERS``) for as long as the connection lives, since uvicorn
does not put the client certificate into the ASGI scope; ``RoleGuard`` looks it up by ``scope["client"]`` and
applies ``policy.authorize``. A refusal is answered 403 with ``KV_UNAUTHORIZED`` in the OpenAI error body, logged
with the peer identity and handed to ``on_refused`` before the app sees the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
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

    def connection_made(self, transport: Any) -> None:
        if self.ssl_context is None or transport.get_extra_info("sslcontext") is not None:
            return self._made(transport)  # plaintext listener, or the handshake below is done
        sock = transport.get_extra_info("socket").dup()  # the connection outlives the plain transport
        sock.setblocking(False)
        transport.set_protocol(asyncio.Protocol())  # its end is not this connection's
        transport.abort()  # from connection_made: nothing was read, and never will be
        self._handshake = self.loop.create_task(self._secure(sock))  # held: a task only the loop refers to can go

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._connected:  # never handed to uvicorn
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

    async def _secure(self, sock: socket.socket) -> None:
        assert self.ssl_context is not None
        peer, first = Peer(None, "", str(_peername(sock)[0])), b""
        # the read timeouts (prfaas.security.readtimeout) time a request head from the connection's start
        deadline = self.loop.time() + min(self.handshake_timeout_s, getattr(self, "header_timeout_s", math.inf))
        try:
            async with asyncio.timeout_at(deadline):
                first = await first_byte(sock)
                if first and first != TLS_HANDSHAKE:
                    self._refuse(peer, PLAINTEXT)
                    body = json.dumps(_error_body(KVUnauthorized("this server accepts TLS 1.3 only"))).encode()
                    await self.loop.sock_sendall(sock, b"HTTP/1.1 403 Forbidden\r\ncontent-type: application/json"
                                                 b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                                 % (len(body), body))
        except (OSError, TimeoutError) as exc:  # the peer left, or said nothing in time
            if not first:  # a plaintext peer that left before its 403 was refused once, above
                self._refuse(peer, handshake_reason(exc))
        finally:
            if first != TLS_HANDSHAKE:  # refused, or a port check that closed without a word
                sock.close()
        if first != TLS_HANDSHAKE:
            return
        try:  # the transport owns the socket from here, and closes it on a failure; connection_made (above)
            async with asyncio.timeout_at(deadline):  # sees it secured
                await self.loop.connect_accepted_socket(lambda: self, sock, ssl=self.ssl_context,
                                                        ssl_handshake_timeout=self.handshake_timeout_s)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            self._refuse(peer, handshake_reason(exc))

    def _refuse(self, peer: Peer, reason: str) -> None:
        refused(None, peer, "tls", reason)  # the log line; on_refused records it
        on_refused = type(self).on_refused
        if on_refused is not None:
            on_refused(peer, "tls", reason)


def tls_protocol(ctx: ssl.SSLContext, on_refused: OnRefused | None = None) -> type[PeerH11Protocol]:
    """The uvicorn ``http`` protocol class for a TLS listener with ``ctx``; handshake refusals go to
    ``on_refused``."""
    return type("TLSPeerH11Protocol", (PeerH11Protocol,), {"ssl_context": ctx, "on_refused": on_refused})


def _peername(sock: socket.socket) -> tuple[str, int]:
    try:
        return sock.getpeername()
    except OSError:  # the peer already left
        return ("", 0)


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

