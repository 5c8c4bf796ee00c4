"""One blob as a store tracks it: sizes, state, readers, and the readers waiting for its next frame. The frames
themselves live in the store's ``FrameBackend``."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from prfaas.records import READY, WRITING, LiveBlob
from prfaas.store.backend import BlobMeta


@dataclass(eq=False)
class Blob:
    kv_id: str
    chunk_size: int
    created: float  # store clock
    created_ms: int  # wall clock
    chunks: int = 0
    ready: bool = False
    payload_xxh64: int | None = None
    nbytes: int = 0
    payload: int = 0
    readers: int = 0
    ended: str | None = None
    tenant: str = ""
    ttl_s: float = 0.0  # this blob's own TTL (a tenant's override); 0: the store's
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(default_factory=list)

    @classmethod
    def adopt(cls, meta: BlobMeta, created: float) -> Blob:
        return cls(meta.kv_id, meta.chunk_size, created, meta.created_ms, meta.chunks, meta.ready,
                   meta.payload_xxh64, meta.nbytes, meta.payload)

    @property
    def state(self) -> str:
        return self.ended or (READY if self.ready else WRITING)

    def meta(self) -> BlobMeta:
        return BlobMeta(self.kv_id, self.chunk_size, self.created_ms, self.chunks, self.payload, self.nbytes,
                        self.payload_xxh64, self.ready)

    def live(self, now: float) -> LiveBlob:
        return LiveBlob(self.kv_id, self.state, self.nbytes, self.chunks, self.readers, round(now - self.created, 3))

    def wake(self) -> None:
        """Tell every reader waiting on this blob that it changed (from any thread; the caller holds the lock)."""
        waiters, self.waiters = self.waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that reader's loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
