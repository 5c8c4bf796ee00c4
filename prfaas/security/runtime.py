"""``Security``: a role's TLS settings, built once at start-up from its config (``Security.of``) and held by the
role, which hands its contexts to every client and server it opens (data-plane push/pull/release, heartbeats, the
router's calls, uvicorn).

Nothing is process-wide: two roles in one process (tests) each hold their own. ``PLAINTEXT``, a frozen value, is
what anything given no ``Security`` uses: every call answers plaintext (None / ``http``), which keeps in-process
tests and plaintext deployments unchanged.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from prfaas import tls as tls_contexts
from prfaas.config import Config, TLSConfig
from prfaas.errors import InvalidRequest


@dataclass(frozen=True)
class Security:
    """A role's TLS: ``tls`` None is plaintext; ``client`` is the context of its outgoing connections."""

    tls: TLSConfig | None = None
    role: str = ""
    client: ssl.SSLContext | None = None

    @classmethod
    def of(cls, config: Config, role: str) -> Security:
        """``config.tls`` for a process running ``role``; ``InvalidRequest`` if TLS is required but not set up or
        a file cannot be loaded. Contexts are built here, so a bad file stops the process at start."""
        if config.tls.required and not tls_contexts.enabled(config.tls):
            raise InvalidRequest("tls.required is set but tls.ca, tls.cert and tls.key are not all given")
        if not tls_contexts.enabled(config.tls):
            return PLAINTEXT
        security = cls(config.tls, role, tls_contexts.client_context(config.tls))
        tls_contexts.server_context(config.tls)
        if config.tls.crl:
            tls_contexts.watch_crls()  # `prfaas certs revoke` takes effect without a restart
        return security

    def enabled(self) -> bool:
        return self.tls is not None

    def required(self) -> bool:
        """Peers must present certificates (``tls.required``)."""
        return self.tls is not None and self.tls.required

    def client_ssl(self) -> ssl.SSLContext | None:
        """The context for the role's outgoing connections (data plane and HTTP), or None for plaintext."""
        return self.client

    def server_ssl(self, client_certs: bool | None = None) -> ssl.SSLContext | None:
        """A new server context (see ``tls.server_context``), or None for plaintext."""
        return tls_contexts.server_context(self.tls, client_certs) if self.tls is not None else None

    def http_verify(self) -> ssl.SSLContext | bool:
        """``verify=`` for httpx clients: our client context (CA + our certificate) or the default."""
        return self.client or True

    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


PLAINTEXT = Security()
