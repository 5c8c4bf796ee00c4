"""Refusals as audit records, on both planes: why a TLS handshake failed, in words an operator can act on, and
the audit log of a process that has no store of its own (router, decode) for its control-plane refusals.

Every refusal becomes an ``AccessRecord`` with outcome ``KV_UNAUTHORIZED`` and ``who`` the peer identity
(``role/name@address`` when a verified certificate named it, else the address): ``action`` says what was refused —
``tls`` (handshake: no, expired, revoked or untrusted certificate, or a plaintext peer), ``api_key`` (missing or
invalid key; the key itself is never recorded, only the reason), or the policy operation (``assign``,
``register``, ``kv.write`` …). Recording never raises.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prfaas.audit import AuditLog
from prfaas.config import StoreConfig
from prfaas.errors import KVUnauthorized
from prfaas.records import AccessRecord
from prfaas.security.identity import Peer

log = logging.getLogger("prfaas.security")
Record = Callable[[AccessRecord], None]
PLAINTEXT = "plaintext peer (not TLS)"
_REASONS = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "no client certificate",
    "UNSUPPORTED_PROTOCOL": "TLS version below 1.3",
    "HTTP_REQUEST": PLAINTEXT, "WRONG_VERSION_NUMBER": PLAINTEXT,
}


def handshake_reason(exc: BaseException) -> str:
    """Why a server-side TLS handshake failed: the certificate verification message (``certificate has
    expired``, ``certificate revoked``, ``unable to get local issuer certificate`` …) or the TLS reason."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return str(exc.verify_message or exc.reason or "certificate verification failed")
    if isinstance(exc, ssl.SSLError):
        return _REASONS.get(str(exc.reason), str(exc.reason or exc).lower().replace("_", " "))
    if isinstance(exc, TimeoutError):
        return "TLS handshake timed out"
    return f"TLS handshake failed ({type(exc).__name__})"


def refused(record: Record | None, peer: Peer, action: str, reason: str, logged: bool = False) -> None:
    """Log (unless the caller ``logged`` it) and record one refusal of ``action`` to ``peer``; ``reason`` goes
    to the log line only."""
    if not logged:
        log.warning("refused %s to %s: %s", action, peer.identity, reason)
    if record is None:
        return
    try:
        record(AccessRecord(action, "", peer.identity, "", 0, KVUnauthorized.code, int(time.time() * 1000)))
    except Exception:  # an audit failure is counted by the log itself; never turn a refusal into a crash
        log.exception("could not record a refusal")


def own_audit(app: Any, config: StoreConfig, name: str) -> Record | None:
    """For a process without a store: an audit log of its own at ``config.audit_log`` (``{instance}`` →
    ``name``; without the placeholder, ``<audit_log>.<name>``, so processes never share one chain), closed when
    ``app`` shuts down; None when no audit log is configured."""
    path = config.audit_log
    if not path:
        return None
    audit = AuditLog(path.replace("{instance}", name) if "{instance}" in path else f"{path}.{name}", name)
    audit.opened(role="control-plane")
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        try:
            async with inner(a) as state:
                yield state
        finally:
            audit.close()

    app.router.lifespan_context = lifespan
    return audit.access
