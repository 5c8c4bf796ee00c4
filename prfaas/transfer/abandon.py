"""``release_abandoned``: end a blob whose request nobody will finish (the client disconnected, decode died or gave
up, the router fell back to local prefill), so it does not wait for its TTL.

Who calls it: the consumer (decode) when its pull fails or is cancelled, and the router when a remote request ends
before decode reported its first token (decode releases right after restoring, before that token) or fails after
it (a vLLM decode streams prefill's first token before it pulls). Call it after
the prefill stream has ended (``done``, ``error``, or closed by the router): a blob still being written is
released too, and its writer then stops with ``KV_NOT_FOUND``.

Failure: never raises a ``PrfaasError``; an already-ended blob (``KV_NOT_FOUND``/``KV_EXPIRED``) is the normal
case and returns ``None``; an unreachable store is logged, and left to the blob's TTL — except by the router's
``Releaser``, which asks again in the background for a while (a relay that was stopped may finish the blob once
it runs again).
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
from typing import Any

from prfaas.errors import KVExpired, KVNotFound, PrfaasError
from prfaas.transfer.client import release

log = logging.getLogger(__name__)


RETRY_EVERY_S = 2.0  # a store that could not be reached is asked again this often ...
RETRY_FOR_S = 30.0  # ... for this long, then the blob's TTL ends it
MAX_RETRYING = 1024  # releases retried at once; past that, the TTL ends the blob


async def release_abandoned(address: str, kv_id: str, *, ssl: ssl_module.SSLContext | None = None,
                            timeout_s: float = 2.0) -> dict[str, Any] | None:
    """Release ``kv_id`` at the store ``address`` (host:port of its data plane); the deletion record (a dict)
    if this call ended it, else ``None``."""
    return (await _attempt(address, kv_id, ssl, timeout_s))[1]


async def _attempt(address: str, kv_id: str, ssl: ssl_module.SSLContext | None,
                   timeout_s: float) -> tuple[bool, dict[str, Any] | None]:
    """(whether the store answered, the deletion record if this call ended the blob)."""
    if not address or not kv_id:
        return True, None
    try:
        async with asyncio.timeout(timeout_s):
            return True, await release(address, kv_id, ssl=ssl, timeout_s=timeout_s)
    except (KVNotFound, KVExpired):
        return True, None
    except (PrfaasError, OSError, TimeoutError) as exc:
        log.warning("could not release abandoned blob %s at %s (%s)", kv_id, address, exc)
        return False, None


class Releaser:
    """The router's releases of abandoned blobs: one attempt at once, and where the store could not be reached (a
    relay stopped or cut off, whose blob may still complete once it is back), more in the background, every
    ``every_s`` for ``for_s``, at most ``max_retrying`` at a time; then the blob's TTL ends it. Owns its tasks
    until ``close``."""

    def __init__(self, ssl: ssl_module.SSLContext | None = None, *, timeout_s: float = 2.0,
                 every_s: float = RETRY_EVERY_S, for_s: float = RETRY_FOR_S, max_retrying: int = MAX_RETRYING
                 ) -> None:
        self.ssl, self.timeout_s, self.every_s, self.for_s = ssl, timeout_s, every_s, for_s
        self.max_retrying = max_retrying
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def retrying(self) -> int:
        return len(self._tasks)

    async def release(self, address: str, kv_id: str) -> None:
        """Never raises; returns after the first attempt."""
        answered, _ = await _attempt(address, kv_id, self.ssl, self.timeout_s)
        if answered:
            return
        if len(self._tasks) >= self.max_retrying:
            log.warning("%d releases already retrying: blob %s at %s is left to its TTL", len(self._tasks), kv_id,
                        address)
            return
        task = asyncio.get_running_loop().create_task(self._retry(address, kv_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retry(self, address: str, kv_id: str) -> None:
        deadline = asyncio.get_running_loop().time() + self.for_s
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(self.every_s)
            if (await _attempt(address, kv_id, self.ssl, self.timeout_s))[0]:
                return
        log.warning("gave up releasing blob %s at %s after %.0f s; its TTL will end it", kv_id, address, self.for_s)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
