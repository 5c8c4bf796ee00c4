"""Who a peer is: the role and name its verified certificate proves (SAN URI ``spiffe://prfaas/<role>/<name>``),
and its address.

Only certificates that passed verification against the CA reach here (``getpeercert()`` returns an empty dict
for an unverified one), so the role is as trustworthy as the CA key. A certificate without a prfaas URI gives a
peer with no role, which ``policy.authorize`` refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PREFIX = "spiffe://prfaas/"


@dataclass(frozen=True)
class Peer:
    role: str | None
    name: str
    address: str

    @property
    def identity(self) -> str:
        """``role/name@address``, or the address alone for a peer without a certificate (audit and logs)."""
        return f"{self.role or '?'}/{self.name}@{self.address}" if self.name else self.address or "peer"


def peer_from_cert(cert: dict[str, Any] | None, address: str = "") -> Peer:
    """The peer a verified certificate (``SSLSocket.getpeercert()``'s dict) names; no cert → role None."""
    for kind, value in (cert or {}).get("subjectAltName", ()):
        if kind == "URI" and value.startswith(PREFIX):
            role, _, name = value[len(PREFIX):].partition("/")
            if role and name and "/" not in name:
                return Peer(role, name, address)
    cn = next((v for rdn in (cert or {}).get("subject", ()) for k, v in rdn if k == "commonName"), "")
    return Peer(None, cn, address)
