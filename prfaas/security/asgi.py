"""Peer identities on the HTTP control plane, and the role guard in front of an app.

uvicorn does not put the client certificate into the ASGI scope, so ``PeerH11Protocol`` records each TLS
connection's verified peer by its client address (``PEERS``) for as long as the connection lives; ``RoleGuard``
looks it up by ``scope["client"]`` and applies ``policy.authorize``. A refusal is answered 403 with
``KV_UNAUTHORIZED`` in the OpenAI error body, logged with the peer identity and handed to ``on_refused`` (the
instance's audit log when it has one) before the app sees the request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from prfaas.errors import KVUnauthorized
from prfaas.security import runtime
from prfaas.security.identity import Peer, peer_from_cert
from prfaas.security.policy import authorize

log = logging.getLogger("prfaas.security")
PEERS: dict[tuple[str, int], Peer] = {}
OnRefused = Callable[[Peer, str, str], None]  # (peer, operation, message)


class PeerH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, remembering the verified client certificate of each connection."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if self.client:
            cert = ssl_object.getpeercert() if ssl_object is not None else None
            PEERS[(str(self.client[0]), int(self.client[1]))] = peer_from_cert(cert, str(self.client[0]))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client:
            PEERS.pop((str(self.client[0]), int(self.client[1])), None)
        super().connection_lost(exc)


def peer_of(scope: dict[str, Any]) -> Peer:
    client = scope.get("client") or ("", 0)
    return PEERS.get((str(client[0]), int(client[1])), Peer(None, "", str(client[0])))


class RoleGuard:
    """ASGI middleware: requests whose path starts with a rule's prefix need that rule's operation."""

    def __init__(self, app: Any, rules: Sequence[tuple[str, str]], on_refused: OnRefused | None = None) -> None:
        self.app, self.rules, self.on_refused = app, rules, on_refused

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        operation = self._operation(scope)
        if operation is None:
            return await self.app(scope, receive, send)
        peer = peer_of(scope)
        try:
            if peer.name or runtime.required():  # no certificate is let through only while TLS is optional
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


async def _forbidden(send: Any, exc: KVUnauthorized) -> None:
    body = json.dumps({"error": {"message": exc.message, "type": "permission_error", "code": exc.code,
                                 "param": None}}).encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
