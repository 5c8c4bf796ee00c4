"""Who may do what: the one table of role permissions, and ``authorize``.

| operation  | what                                                  | allowed roles            |
|------------|-------------------------------------------------------|--------------------------|
| kv.write   | data plane Put: create a blob                          | prefill                  |
| kv.read    | data plane Get                                        | decode, router           |
| kv.release | data plane Release (decode after restore; router abandons) | decode, router      |
| kv.stat    | data plane Stat (health and leak checks)              | router, decode, prefill, relay |
| assign     | instance /prefill, /generate, /tokenize               | router                   |
| register   | router /internal/heartbeat, /internal/deregister      | prefill, decode, relay   |

``register`` only admits the role; which role and instance id a registration may claim is bound to the
certificate (or API key) by ``prfaas.security.registration``.
| inspect    | instance /stats, /debug/store, /health, /metrics      | any role                 |
"""

from __future__ import annotations

from prfaas.errors import KVUnauthorized

ALL_ROLES = frozenset({"router", "prefill", "decode", "relay"})
PERMISSIONS: dict[str, frozenset[str]] = {
    "kv.write": frozenset({"prefill"}),
    "kv.read": frozenset({"decode", "router"}),
    "kv.release": frozenset({"decode", "router"}),
    "kv.stat": ALL_ROLES,
    "assign": frozenset({"router"}),
    "register": frozenset({"prefill", "decode", "relay"}),
    "inspect": ALL_ROLES,
}


def authorize(peer_role: str | None, operation: str) -> None:
    """Return if ``peer_role`` may perform ``operation``; else raise ``KVUnauthorized`` (an unknown operation or
    a peer without a role is refused: the table is an allow-list)."""
    allowed = PERMISSIONS.get(operation, frozenset())
    if peer_role not in allowed:
        who = f"role {peer_role!r}" if peer_role else "a peer without a prfaas role certificate"
        raise KVUnauthorized(f"{who} may not {operation} (allowed: {', '.join(sorted(allowed)) or 'nobody'})")
