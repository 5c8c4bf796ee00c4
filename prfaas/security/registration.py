"""Who may register which instance with the router (``/internal/heartbeat``, ``/internal/deregister``).

A heartbeat claims an instance id and a role; the router then sends that instance prompts' token ids, ``kv_id``s
and KV addresses. So the claim is bound to who sends it, the *registrant*, proved by the first of:

- a verified client certificate (TLS), SAN URI ``spiffe://prfaas/<role>/<name>``: the claimed role must be the
  certificate's role, and the instance id must be ``<name>`` or start with ``<name>-``. The role certificates of
  ``prfaas certs init`` are named after their role, so ``prefill`` covers ``prefill-0``, ``prefill-1`` … as
  ``prfaas up --tls`` and ``prfaas serve`` (``<role>-<port>``) name instances; a per-instance certificate
  ``prefill-7`` (``prfaas certs issue --name prefill-7``) covers ``prefill-7``. Owner: ``cert:<role>/<name>``.
- else, when ``api_keys`` are configured, an API key (``Authorization: Bearer``): a key with ``roles`` may register
  only those roles; when no configured key carries ``roles`` (configs from before keys had them) any valid key may
  register any role. Once one key carries ``roles``, keys without them cannot register. Owner: ``key:<name>``.
- else, on a router without TLS and without keys (it only binds loopback, ``apikeys.check_exposure``), nobody is
  checked: owner "". With TLS on but not required and no keys, such a peer proved nothing and is refused.

The registry (``prfaas.services.registry``) binds each instance id to the owner that registered it: a heartbeat or
deregister for a live id from another owner is refused, so one owner's instance can neither take over nor remove
another owner's (instances sharing one certificate or key are one owner).
Every refusal is ``KVUnauthorized`` (403), never a partial registration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prfaas.errors import KVUnauthorized
from prfaas.security.apikeys import ApiKey, match
from prfaas.security.identity import Peer

OPEN = ""  # the owner of a registration nobody could authenticate (no TLS, no keys)


@dataclass(frozen=True)
class Registrar:
    """The router's checks on ``/internal/*`` for the configured ``keys``; stateless (owners live in the
    registry)."""

    keys: Sequence[ApiKey] = ()
    tls: bool = False  # the router serves TLS: a peer without a certificate must then bring a key

    @property
    def strict(self) -> bool:
        """Keys carry roles: only keys naming a role may register it."""
        return any(key.roles is not None for key in self.keys)

    def claim(self, peer: Peer, authorization: str, role: str, instance_id: str) -> str:
        """The owner of a registration of ``instance_id`` as ``role`` by ``peer`` (whose ``Authorization``
        header is ``authorization``); ``KVUnauthorized`` if the registrant may not make it."""
        if peer.name:
            return _by_certificate(peer, role, instance_id)
        if not self.keys:
            return self._open()
        key = self._key(authorization)
        if self.strict and role not in (key.roles or ()):
            raise KVUnauthorized(f"API key {key.name!r} may not register an instance of role {role!r}")
        return f"key:{key.name}"

    def identify(self, peer: Peer, authorization: str) -> str:
        """The owner ``peer`` speaks for (deregistration: it may remove only what it registered)."""
        if peer.name:
            return _owner(peer)
        return f"key:{self._key(authorization).name}" if self.keys else self._open()

    def _open(self) -> str:
        """No certificate and no keys configured: only a router without TLS (bound to loopback,
        ``apikeys.check_exposure``) lets such a peer register; with TLS on but not required, a client without a
        certificate proves nothing and may reach a public port."""
        if self.tls:
            raise KVUnauthorized("registering with this router needs a prfaas role certificate (or an API key)")
        return OPEN

    def _key(self, authorization: str) -> ApiKey:
        scheme, _, token = authorization.partition(" ")
        key = match(self.keys, token.strip().encode()) if scheme.lower() == "bearer" else None
        if key is None:
            raise KVUnauthorized("registering with this router needs a valid API key (Authorization: Bearer)")
        return key


def _by_certificate(peer: Peer, role: str, instance_id: str) -> str:
    if peer.role != role:
        raise KVUnauthorized(f"a certificate of role {peer.role!r} may not register an instance of role {role!r}")
    if instance_id != peer.name and not instance_id.startswith(f"{peer.name}-"):
        raise KVUnauthorized(f"certificate {peer.name!r} may register instance ids {peer.name!r} or "
                             f"{peer.name!r}-…, not {instance_id!r}")
    return _owner(peer)


def _owner(peer: Peer) -> str:
    return f"cert:{peer.role}/{peer.name}"


def credential(keys: Sequence[ApiKey], role: str) -> dict[str, str]:
    """The ``Authorization`` header an instance of ``role`` registers with: the first key whose ``roles`` name
    ``role``, else (no key carries roles) the first key; none without keys. Never logged."""
    strict = any(key.roles is not None for key in keys)
    key = next((k for k in keys if not strict or role in (k.roles or ())), None)
    return {"authorization": f"Bearer {key.secret.decode()}"} if key is not None else {}
