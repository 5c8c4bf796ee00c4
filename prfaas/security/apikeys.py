"""Public API keys on the router (``Authorization: Bearer <key>``) and the start-up exposure check.

Config: ``api_keys`` is a list whose items are either a key string (named ``key-<n>``) or a mapping
``{name, key, rate_limit_qps, tenant, roles}``. ``roles`` (instance roles: prefill, decode, relay) are the roles an
instance holding the key may register as on the router's ``/internal/*`` when it has no certificate
(``prfaas.security.registration``). A key's ``tenant`` (default ``default``) is whose requests it makes: the
guard puts it in the request's ``state`` for the router (``prfaas.tenancy``). Keys are compared in constant time
(``hmac.compare_digest``, against every key, so the time does not say which one came close); only key *names* ever
reach logs, metrics or responses. Each key may carry its own token-bucket rate limit (429 with ``Retry-After``).
With no keys configured the guard lets every request through: ``check_exposure`` makes sure that only happens on
loopback (or with TLS, or ``--insecure``).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prfaas import tls
from prfaas.config import Config
from prfaas.errors import InvalidRequest
from prfaas.ratelimit import TokenBucket
from prfaas.security.policy import PERMISSIONS
from prfaas.tenancy.policy import DEFAULT_TENANT, parse_policy

log = logging.getLogger("prfaas.security")
PROTECTED = ("/v1/", "/admin/")
INSTANCE_ROLES = PERMISSIONS["register"]  # the roles that register with the router


@dataclass
class ApiKey:
    name: str
    secret: bytes = field(repr=False)
    bucket: TokenBucket | None = None
    tenant: str = DEFAULT_TENANT
    roles: frozenset[str] | None = None  # instance roles it may register as; None: not given (see registration)

    def __repr__(self) -> str:  # never print the secret
        return f"ApiKey(name={self.name!r})"


def parse_keys(items: Sequence[Any]) -> list[ApiKey]:
    """The configured keys; ``InvalidRequest`` for an empty, short or duplicate key or an unknown field."""
    keys: list[ApiKey] = []
    for n, item in enumerate(items):
        spec = {"key": item} if isinstance(item, str) else dict(item) if isinstance(item, dict) else None
        if spec is None or set(spec) - {"name", "key", "rate_limit_qps", "tenant", "roles"}:
            raise InvalidRequest(f"api_keys[{n}]: a key string or {{name, key, rate_limit_qps, tenant, roles}}")
        secret, name, qps = str(spec.get("key") or ""), str(spec.get("name") or f"key-{n}"), spec.get("rate_limit_qps")
        if len(secret) < 16:
            raise InvalidRequest(f"api_keys[{n}] ({name}): keys must be at least 16 characters")
        if any(hmac.compare_digest(secret.encode(), k.secret) for k in keys) or name in {k.name for k in keys}:
            raise InvalidRequest(f"api_keys[{n}] ({name}): duplicate key or name")
        tenant = str(spec.get("tenant") or DEFAULT_TENANT)
        parse_policy(tenant, {})  # a valid tenant name
        keys.append(ApiKey(name, secret.encode(), TokenBucket(float(qps)) if qps else None, tenant,
                           _roles(spec.get("roles"), f"api_keys[{n}] ({name})")))
    return keys


def _roles(value: Any, where: str) -> frozenset[str] | None:
    """A key's ``roles``: a list of instance roles (``InvalidRequest`` for anything else); None when absent."""
    if value is None:
        return None
    roles = [value] if isinstance(value, str) else value
    if not isinstance(roles, list) or not set(roles) <= INSTANCE_ROLES:
        raise InvalidRequest(f"{where}.roles: a list of {', '.join(sorted(INSTANCE_ROLES))}")
    return frozenset(roles)


def match(keys: Sequence[ApiKey], presented: bytes) -> ApiKey | None:
    """The key equal to ``presented`` (constant time per key, every key compared), or None."""
    found = None
    for key in keys:
        if hmac.compare_digest(key.secret, presented):
            found = key
    return found


class ApiKeyGuard:
    """ASGI middleware for ``/v1/*``: 401 without a valid key, 429 over the key's rate; passes all when no keys."""

    def __init__(self, app: Any, keys: Sequence[ApiKey]) -> None:
        self.app, self.keys = app, list(keys)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self.keys or scope["type"] != "http" or not str(scope.get("path", "")).startswith(PROTECTED):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        key = match(self.keys, token.strip()) if scheme.lower() == b"bearer" else None
        if key is None:
            client = (scope.get("client") or ("?",))[0]
            log.warning("refused %s from %s: %s API key", scope.get("path"), client, "invalid" if token else "no")
            message = "Incorrect API key provided." if token else "Missing API key: send Authorization: Bearer KEY."
            return await _reply(send, 401, message, "invalid_api_key", "authentication_error")
        wait = key.bucket.take() if key.bucket else 0.0
        if wait > 0:
            return await _reply(send, 429, f"rate limit of API key {key.name!r} exceeded", "RATE_LIMITED",
                                "rate_limit_error", retry_after=TokenBucket.retry_after(wait))
        scope.setdefault("state", {})["tenant"] = key.tenant
        await self.app(scope, receive, send)


async def _reply(send: Any, status: int, message: str, code: str, kind: str, retry_after: int = 0) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": code, "param": None}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if retry_after:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_config_file(path: str | None, config: Config) -> None:
    """Refuse (``InvalidRequest``) a config file that holds API keys or client-cluster keys and is readable by
    every user."""
    path = path or os.environ.get("PRFAAS_CONFIG")
    cluster_keys = any(isinstance(entry, dict) and entry.get("key") for entry in config.clusters.values())
    if path and (config.common.api_keys or cluster_keys) and os.stat(path).st_mode & stat.S_IROTH:
        raise InvalidRequest(f"{path} holds keys (api_keys or clusters) and is world-readable; run "
                             f"`chmod o-rwx {path}`")


def check_exposure(host: str, config: Config, insecure: bool = False) -> None:
    """Refuse (``InvalidRequest``, saying why) to serve the public API on a non-loopback ``host`` with neither API
    keys nor TLS, unless ``insecure``."""
    if loopback(host) or insecure or config.common.api_keys or tls.enabled(config.tls):
        return
    raise InvalidRequest(
        f"refusing to bind the router to {host}: it is reachable from other hosts, and with no api_keys and no "
        "tls configured anyone who can reach it could use it. Configure api_keys (and/or tls: {ca, cert, key}), "
        "bind to 127.0.0.1, or pass --insecure to accept the risk.")
