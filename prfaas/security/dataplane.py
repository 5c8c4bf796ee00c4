"""Authorisation on the KV data plane: the ``authorize`` hook of ``TransferServer``.

Each request is mapped to a policy operation (Put → ``kv.write``, Get → ``kv.read``, Release → ``kv.release``,
Stat → ``kv.stat``) and checked against the role of the connection's verified client certificate before it
touches the store. A refusal raises ``KVUnauthorized`` (the server answers it on the wire and closes) after an
``AccessRecord`` with outcome ``KV_UNAUTHORIZED`` and the peer identity went to ``on_refused`` (the store's audit
log and metrics). A peer without a certificate is only let through while TLS is not required. A failed handshake
(``tls_refused``: plaintext, or a certificate expired, revoked, from another CA or missing) is recorded the same
way, as action ``tls``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prfaas.errors import KVUnauthorized
from prfaas.security.identity import Peer, peer_from_cert
from prfaas.security.policy import authorize
from prfaas.security.refusals import PLAINTEXT, handshake_reason, refused
from prfaas.store import AccessRecord
from prfaas.transfer import protocol as p

log = logging.getLogger("prfaas.security")
OPERATIONS: dict[type, tuple[str, str]] = {  # request type → (policy operation, store access action)
    p.Put: ("kv.write", "create"), p.Get: ("kv.read", "read"), p.Release: ("kv.release", "release"),
    p.Stat: ("kv.stat", "stat"),
}


class DataPlaneGuard:
    def __init__(self, required: bool, on_refused: Callable[[AccessRecord], None] | None = None) -> None:
        self.required, self.on_refused = required, on_refused

    def __call__(self, request: p.Message, conn: Any) -> None:
        operation, action = OPERATIONS.get(type(request), ("kv.unknown", "unknown"))
        peer = connection_peer(conn)
        if not peer.name and not self.required:
            return
        try:
            authorize(peer.role, operation)
        except KVUnauthorized as exc:
            kv_id = str(getattr(request, "kv_id", ""))
            log.warning("refused %s of %s to %s: %s", operation, kv_id or "-", peer.identity, exc.message)
            if self.on_refused is not None:
                self.on_refused(AccessRecord(action, kv_id, peer.identity, "", 0, exc.code, int(time.time() * 1000)))
            raise


    def tls_refused(self, conn: Any, exc: BaseException | None) -> None:
        """``TransferServer.on_tls_refused``: a failed handshake (``exc``; None for a plaintext peer), recorded as
        a ``tls`` refusal with the peer's address."""
        refused(self.on_refused, connection_peer(conn), "tls", PLAINTEXT if exc is None else handshake_reason(exc))


def connection_peer(conn: Any) -> Peer:
    """The verified peer of a data-plane ``Conn`` (no TLS or no certificate: a peer without a name)."""
    try:
        address = str(conn.sock.getpeername()[0])
    except OSError:
        address = ""
    tls = getattr(conn, "tls", None)
    try:
        cert = tls.getpeercert() if tls is not None else None
    except ValueError:  # the handshake did not complete
        cert = None
    return peer_from_cert(cert, address)
