"""Where a prefill's blob frames go: its own store (direct mode) or a relay's store over the WAN (relay mode).

Frames arrive on the event loop (the engine thread hands them over with ``call_soon_threadsafe``) in order:
the header frame when the sink is made, chunk frames as layers finish, and the trailer last.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Protocol

from prfaas.security import runtime as tls_runtime
from prfaas.store import BlobStore, accessing
from prfaas.transfer import push


class FrameSink(Protocol):
    def put(self, frames: list[bytes]) -> None: ...
    async def finish(self, frames: list[bytes]) -> None: ...
    async def abort(self, reason: str) -> None: ...


class StoreSink:
    """Direct mode: the blob lives in this prefill's store; decode pulls it from our transfer server."""

    def __init__(self, store: BlobStore, kv_id: str, header: bytes, tenant: str = "", ttl_s: float = 0.0) -> None:
        self.store, self.kv_id = store, kv_id
        with accessing(tenant=tenant):
            store.create(kv_id, header, ttl_s)

    def put(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.store.append(self.kv_id, frame)

    async def finish(self, frames: list[bytes]) -> None:
        self.put(frames[:-1])
        self.store.finish(self.kv_id, frames[-1])

    async def abort(self, reason: str) -> None:
        self.store.abort(self.kv_id, reason)


class PushSink:
    """Relay mode: frames stream to the relay on one connection while the forward pass goes on. ``tls`` None:
    the process's own TLS settings (``prfaas.security.runtime``), plaintext when there are none."""

    def __init__(self, address: str, kv_id: str, header: bytes, timeout_s: float,
                 tls: ssl.SSLContext | None, tenant: str = "", ttl_s: float = 0.0) -> None:
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._queue.put_nowait(header)
        self._task = asyncio.create_task(push(address, kv_id, self._frames(), ssl=tls or tls_runtime.client_ssl(),
                                              timeout_s=timeout_s, tenant=tenant, ttl_s=ttl_s))

    async def _frames(self) -> AsyncIterator[bytes]:
        while frame := await self._queue.get():  # an empty frame marks the end
            yield frame

    def put(self, frames: list[bytes]) -> None:
        for frame in frames:
            self._queue.put_nowait(frame)

    async def finish(self, frames: list[bytes]) -> None:
        self.put(frames)
        self._queue.put_nowait(b"")
        await self._task

    async def abort(self, reason: str) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
