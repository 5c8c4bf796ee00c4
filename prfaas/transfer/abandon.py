"""``release_abandoned``: end a blob whose request nobody will finish (the client disconnected, decode died or gave
up, the router fell back to local prefill), so it does not wait for its TTL.

Who calls it: the consumer (decode) when its pull fails or is cancelled, and the router when a remote request ends
before decode reported its first token (decode releases right after restoring, before that token). Call it after
the prefill stream has ended (``done``, ``error``, or closed by the router): a blob still being written is
released too, and its writer then stops with ``KV_NOT_FOUND``.

Failure: never raises a ``PrfaasError``; an already-ended blob (``KV_NOT_FOUND``/``KV_EXPIRED``) is the normal
case and returns ``None``; an unreachable store is logged and left to the blob's TTL.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
from typing import Any

from prfaas.errors import KVExpired, KVNotFound, PrfaasError
from prfaas.transfer.client import release

log = logging.getLogger(__name__)


async def release_abandoned(address: str, kv_id: str, *, ssl: ssl_module.SSLContext | None = None,
                            timeout_s: float = 2.0) -> dict[str, Any] | None:
    """Release ``kv_id`` at the store ``address`` (host:port of its data plane); the deletion record (a dict)
    if this call ended it, else ``None``."""
    if not address or not kv_id:
        return None
    try:
        async with asyncio.timeout(timeout_s):
            return await release(address, kv_id, ssl=ssl, timeout_s=timeout_s)
    except (KVNotFound, KVExpired):
        return None
    except (PrfaasError, OSError, TimeoutError) as exc:
        log.warning("could not release abandoned blob %s at %s (%s); its TTL will end it", kv_id, address, exc)
        return None
