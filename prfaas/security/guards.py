"""Where the role guard and the API keys sit in front of each role's HTTP app (called by the services).

Instances: only the router may assign work (``/prefill``, ``/generate``, ``/tokenize``); ``/stats`` and
``/debug`` need any prfaas role. Router: only instances may register (``/internal/*``); ``/v1/*`` and
``/admin/*`` need an API key when keys are configured. Refusals on an instance with a store are also written to
its audit log (an access record with outcome ``KV_UNAUTHORIZED`` and the peer identity).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prfaas.config import Config
from prfaas.errors import KVUnauthorized
from prfaas.security import runtime
from prfaas.security.apikeys import ApiKeyGuard, parse_keys
from prfaas.security.asgi import RoleGuard
from prfaas.security.identity import Peer
from prfaas.store import AccessRecord

INSTANCE_RULES = (("/prefill", "assign"), ("/generate", "assign"), ("/tokenize", "assign"),
                  ("/stats", "inspect"), ("/debug/", "inspect"))
ROUTER_RULES = (("/internal/", "register"),)


def protect_instance(app: Any, record: Callable[[AccessRecord], None] | None = None) -> None:
    """Add the role guard to an instance's app when this process runs TLS; ``record`` gets each refusal."""
    if not runtime.enabled():
        return

    def refused(peer: Peer, operation: str, message: str) -> None:
        if record is not None:
            record(AccessRecord(operation, "", peer.identity, "", 0, KVUnauthorized.code, int(time.time() * 1000)))

    app.add_middleware(RoleGuard, rules=INSTANCE_RULES, on_refused=refused)


def protect_router(app: Any, config: Config) -> None:
    """API keys on the public routes (when configured) and, with TLS, the role guard on ``/internal/*``."""
    if runtime.enabled():
        app.add_middleware(RoleGuard, rules=ROUTER_RULES)
    keys = parse_keys(config.api_keys)
    if keys:
        app.add_middleware(ApiKeyGuard, keys=keys)
