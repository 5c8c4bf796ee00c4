"""Security: a private CA and per-role certificates (``certs``), TLS 1.3 contexts (``tls``), the role a peer's
certificate proves (``identity``), who may do what (``policy``), public API keys (``apikeys``), and the process's
own TLS settings shared by its clients and servers (``runtime``)."""

from prfaas.security.identity import Peer, peer_from_cert
from prfaas.security.policy import authorize

__all__ = ["Peer", "authorize", "peer_from_cert"]
