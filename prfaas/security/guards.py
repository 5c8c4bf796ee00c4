"""Where the role guard, the API keys and the body limit sit in front of each role's HTTP app (called by the
services).

Every app: request bodies over ``limits.max_body_bytes`` are refused (413); the app keeps its role's limits in
``app.state.limits``, where ``prfaas.services.http.serve`` and ``prfaas.services.jsonbody`` read them. Instances: only
the router may assign work (``/prefill``, ``/generate``, ``/tokenize``); ``/stats`` and ``/debug`` need any prfaas role.
Router: only instances may register (``/internal/*``); ``/v1/*`` and ``/admin/*`` need an API key when keys are
configured.
Every refusal — a role refused (403), a missing or invalid API key (401), a failed TLS handshake (plaintext,
expired, revoked or untrusted certificate) — is written to the audit log with the peer identity
(``prfaas.security.refusals``): the store's log on an instance with a store, else the process's own log at
``audit_log`` (``{instance}`` → the instance id, or ``router``).
"""

from __future__ import annotations

from typing import Any

from prfaas.config import Config
from prfaas.limits import DEFAULT, WireLimits
from prfaas.security.apikeys import PROTECTED, ApiKeyGuard, parse_keys
from prfaas.security.asgi import RoleGuard, peer_of
from prfaas.security.bodylimit import BodyLimit
from prfaas.security.identity import Peer
from prfaas.security.refusals import Record, own_audit, refused
from prfaas.security.runtime import PLAINTEXT, Security

INSTANCE_RULES = (("/prefill", "assign"), ("/generate", "assign"), ("/tokenize", "assign"),
                  ("/stats", "inspect"), ("/debug/", "inspect"))
ROUTER_RULES = (("/internal/", "register"),)


def protect_instance(app: Any, record: Record | None = None, config: Config | None = None, name: str = "",
                     security: Security = PLAINTEXT) -> None:
    """The body limit, and with TLS the role guard; ``record`` gets each refusal (an instance without a store
    passes ``config`` and its ``name`` to get an audit log of its own); ``config.limits`` (the defaults
    without a config) bound its requests."""
    limit_requests(app, config.limits if config is not None else DEFAULT)
    if not security.enabled():
        return
    if record is None and config is not None:
        record = own_audit(app, config.store, name)
    on_refused = _recorder(record)
    app.state.tls_refused = on_refused
    app.add_middleware(RoleGuard, rules=INSTANCE_RULES, on_refused=on_refused, required=security.required())


def protect_router(app: Any, config: Config, security: Security = PLAINTEXT) -> None:
    """The body limit, API keys on the public routes (when configured) and, with TLS, the role guard on
    ``/internal/*``; refusals go to the router's own audit log when ``audit_log`` is set."""
    limit_requests(app, config.limits)
    record = own_audit(app, config.store, "router")
    on_refused = _recorder(record)
    app.state.tls_refused = on_refused
    if security.enabled():
        app.add_middleware(RoleGuard, rules=ROUTER_RULES, on_refused=on_refused, required=security.required())
    keys = parse_keys(config.common.api_keys)
    if keys:
        app.add_middleware(ApiKeyGuard, keys=keys)
        app.add_middleware(KeyRefusals, record=record)


def limit_requests(app: Any, limits: WireLimits) -> None:
    """``limits`` for ``app``'s requests: its body limit here, the rest read from ``app.state.limits``."""
    app.state.limits = limits
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)


def limits_of(app: Any) -> WireLimits:
    """The limits ``limit_requests`` gave ``app``; the defaults for an app it never saw."""
    limits: WireLimits = getattr(app.state, "limits", DEFAULT)
    return limits


def _recorder(record: Record | None) -> Any:
    def on_refused(peer: Peer, operation: str, message: str) -> None:
        refused(record, peer, operation, message, logged=True)

    return on_refused


class KeyRefusals:
    """Outside ``ApiKeyGuard``: records each 401 it answers on a protected route (``api_key``, with the peer and
    whether the key was missing or wrong; never the key)."""

    def __init__(self, app: Any, record: Record | None) -> None:
        self.app, self.record = app, record

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(PROTECTED):
            return await self.app(scope, receive, send)

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message.get("status") == 401:
                sent = dict(scope.get("headers") or []).get(b"authorization")
                refused(self.record, peer_of(scope), "api_key", "invalid" if sent else "missing", logged=True)
            await send(message)

        await self.app(scope, receive, watched)
