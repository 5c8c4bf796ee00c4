"""One blob as a store holds it: its frames, sizes, readers, and the readers waiting for its next frame."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from prfaas.store.records import READY, WRITING


@dataclass(eq=False)
class Blob:
    kv_id: str
    header: bytes
    chunk_size: int
    created: float  # store clock
    created_ms: int  # wall clock
    chunks: list[bytes] = field(default_factory=list)
    trailer: bytes | None = None
    payload_xxh64: int | None = None
    nbytes: int = 0
    payload: int = 0
    readers: int = 0
    ended: str | None = None
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(default_factory=list)

    @property
    def state(self) -> str:
        return self.ended or (READY if self.trailer is not None else WRITING)

    def wake(self) -> None:
        """Tell every reader waiting on this blob that it changed (from any thread; the caller holds the lock)."""
        waiters, self.waiters = self.waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that reader's loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
