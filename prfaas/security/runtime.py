"""This process's TLS settings, set once at start-up by ``prfaas serve`` (``configure``) and read by every client
and server the role opens (data-plane push/pull/release, heartbeats, the router's calls, uvicorn).

One process runs one role, so one setting per process is enough; with nothing configured every call returns the
plaintext answer (None / ``http``), which keeps in-process tests and plaintext deployments unchanged.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from prfaas.config import Config, TLSConfig
from prfaas.security import limits
from prfaas.security import tls as tls_contexts


@dataclass
class _Settings:
    tls: TLSConfig
    role: str
    client: ssl.SSLContext | None = None


_CURRENT: _Settings | None = None


def configure(config: Config, role: str) -> None:
    """Use ``config.tls`` and ``config.limits`` for this process (as ``role``); ``InvalidRequest`` if TLS is
    required but not set up or a file cannot be loaded. Contexts are built here, so a bad file stops the process
    at start."""
    global _CURRENT
    limits.configure(config.limits)
    if config.tls.required and not tls_contexts.enabled(config.tls):
        from prfaas.errors import InvalidRequest

        raise InvalidRequest("tls.required is set but tls.ca, tls.cert and tls.key are not all given")
    if not tls_contexts.enabled(config.tls):
        _CURRENT = None
        return
    _CURRENT = _Settings(config.tls, role, tls_contexts.client_context(config.tls))
    tls_contexts.server_context(config.tls)
    if config.tls.crl:
        tls_contexts.watch_crls()  # `prfaas certs revoke` takes effect without a restart


def enabled() -> bool:
    return _CURRENT is not None


def required() -> bool:
    """Peers must present certificates (``tls.required``)."""
    return _CURRENT is not None and _CURRENT.tls.required


def client_ssl() -> ssl.SSLContext | None:
    """The context for this process's outgoing connections (data plane and HTTP), or None for plaintext."""
    return _CURRENT.client if _CURRENT else None


def server_ssl(client_certs: bool | None = None) -> ssl.SSLContext | None:
    """A new server context (see ``tls.server_context``), or None for plaintext."""
    return tls_contexts.server_context(_CURRENT.tls, client_certs) if _CURRENT else None


def http_verify() -> ssl.SSLContext | bool:
    """``verify=`` for httpx clients: our client context (CA + our certificate) or the default."""
    return client_ssl() or True


def scheme() -> str:
    return "https" if _CURRENT else "http"
