"""Security: a private CA and per-role certificates (``certs``), the role a peer's certificate proves
(``identity``), who may do what (``policy``), public API keys (``apikeys``), the guards and refusals of the data
plane and the control plane (``dataplane``, ``guards``, ``refusals``), and the process's own TLS settings shared by
its clients and servers (``runtime``).

This package sits above the data plane, the store and the audit log, whose policy it is; the ground floor it builds
on lives below them: TLS 1.3 contexts in ``prfaas.tls``, wire limits in ``prfaas.limits``."""

from prfaas.security.identity import Peer, peer_from_cert
from prfaas.security.policy import authorize

__all__ = ["Peer", "authorize", "peer_from_cert"]
