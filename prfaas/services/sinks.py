"""Where a prefill's blob frames go: its own store (direct mode) or a relay's store over the WAN (relay mode).

Frames are handed over in order: the header frame when the sink is made, chunk frames as layers finish
(``hand_over``, on the engine thread), and the rest with the trailer last (``finish``, on the event loop). The
prefill says ``accepted`` only after ``ready()``: the blob exists where decode will read it, so decode's first Get
finds it (no ``KV_NOT_FOUND`` race).
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

from prfaas.errors import KVTimeout, PrfaasError
from prfaas.kv.format import Frame
from prfaas.store import BlobStore, accessing
from prfaas.transfer import TransferContext, push

PUSH_QUEUE_BYTES = 64 << 20  # frames a push may hold that the relay has not taken yet (per blob)


class FrameSink(Protocol):
    async def ready(self) -> None:
        """Returns once the blob exists where its readers look; raises the sink's error otherwise."""

    def hand_over(self, frames: list[Frame]) -> None:
        """Engine thread: queue ``frames``; may block while the sink is full (back-pressure)."""

    async def finish(self, frames: list[Frame]) -> None: ...
    async def abort(self, reason: str) -> None: ...


class StoreSink:
    """Direct mode: the blob lives in this prefill's store; decode pulls it from our transfer server."""

    def __init__(self, store: BlobStore, kv_id: str, header: bytes, tenant: str = "", ttl_s: float = 0.0) -> None:
        self.store, self.kv_id = store, kv_id
        self._loop = asyncio.get_running_loop()
        self._aborted = False
        with accessing(tenant=tenant):
            store.create(kv_id, header, ttl_s)

    async def ready(self) -> None:
        return None  # created in __init__

    def hand_over(self, frames: list[Frame]) -> None:
        self._loop.call_soon_threadsafe(self._append, frames)  # the store is the event loop's

    def _append(self, frames: list[Frame]) -> None:
        if self._aborted:  # layers the engine finished after the request ended: nobody wants them
            return
        for frame in frames:
            self.store.append(self.kv_id, bytes(frame))  # a no-op for bytes: a store keeps no pooled buffer

    async def finish(self, frames: list[Frame]) -> None:
        self._append(frames[:-1])
        self.store.finish(self.kv_id, bytes(frames[-1]))

    async def abort(self, reason: str) -> None:
        self._aborted = True
        self.store.abort(self.kv_id, reason)


class PushSink:
    """Relay mode: frames stream to the relay on one connection while the forward pass goes on. ``tls`` None:
    the role's client TLS context, plaintext when it is None.

    Bounded: at most ``max_queued_bytes`` wait for the connection (one frame always may, whatever its size).
    ``hand_over`` blocks the engine thread while the queue is full — back-pressure onto the forward pass — for at
    most ``timeout_s``; then the push is refused: it stops, later frames are dropped, and ``finish`` raises
    ``KVTimeout``. A push that fails wakes a blocked ``hand_over`` at once. ``deadline_s`` bounds the whole push.
    ``context``: the role's (``prfaas.transfer.push``): its recorders keep every push's figures."""

    def __init__(self, address: str, kv_id: str, header: bytes, timeout_s: float,
                 tls: ssl.SSLContext | None, tenant: str = "", ttl_s: float = 0.0,
                 max_queued_bytes: int = PUSH_QUEUE_BYTES, deadline_s: float | None = None,
                 context: TransferContext | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._what, self._timeout_s, self._limit = f"the push of {kv_id} to {address}", timeout_s, max_queued_bytes
        self._room = threading.Condition()
        self._queued = 0  # bytes handed over that the connection has not taken yet (guarded by _room)
        self._refused: PrfaasError | None = None
        self._ended = False
        # One queue for both threads, in the order the frames were handed over (guarded by _room): the engine
        # thread's last chunks come before the trailer ``finish`` adds, however late the loop wakes for them.
        self._pending: deque[Frame] = deque()
        self._arrived = asyncio.Event()  # set on the loop when _pending may have grown
        self._created: asyncio.Future[None] = self._loop.create_future()
        self._add(header)
        self._task = asyncio.create_task(push(address, kv_id, self._frames(), ssl=tls,
                                              timeout_s=timeout_s, deadline_s=deadline_s, tenant=tenant,
                                              ttl_s=ttl_s, on_created=self._on_created, context=context))
        self._task.add_done_callback(lambda _: self._wake(ended=True))

    @property
    def queued_bytes(self) -> int:
        """Bytes handed over that the connection has not taken yet: at most ``max_queued_bytes`` + one frame."""
        return self._queued

    async def ready(self) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await asyncio.wait({self._created, self._task}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError as exc:
            raise KVTimeout(f"{self._what}: the relay did not create the blob within {self._timeout_s:g} s") from exc
        if not self._created.done():
            await self._task  # it ended before the relay created the blob: its error says why

    def hand_over(self, frames: list[Frame]) -> None:
        for frame in frames:
            if not self._wait_room(frame):
                return  # refused or ended: nothing more is queued; finish raises why
            self._loop.call_soon_threadsafe(self._arrived.set)

    def _wait_room(self, frame: Frame) -> bool:
        n = len(frame)
        wait_s = 0.0 if threading.get_ident() == self._loop_thread else self._timeout_s  # the loop cannot wait
        with self._room:
            fits = self._room.wait_for(lambda: self._ended or self._queued == 0 or self._queued + n <= self._limit,
                                       timeout=wait_s)
            if self._ended or self._refused is not None:
                return False
            if not fits:
                self._refused = KVTimeout(f"{self._what} stayed {self._limit} bytes behind for "
                                          f"{self._timeout_s:g} s; refused")
                self._loop.call_soon_threadsafe(self._task.cancel)
                return False
            self._queued += n
            self._pending.append(frame)
            return True

    def _add(self, frame: Frame) -> None:
        """Event loop: queue a frame without waiting (the header, the last layer and the trailer)."""
        with self._room:
            self._queued += len(frame)
            self._pending.append(frame)
        self._arrived.set()

    async def _frames(self) -> AsyncIterator[Frame]:
        while True:
            with self._room:
                frame = self._pending.popleft() if self._pending else None
                if frame is not None:
                    self._queued -= len(frame)
                    self._room.notify_all()
            if frame is None:
                self._arrived.clear()  # a later hand-over sets it again: its callback runs after this one
                await self._arrived.wait()
                continue
            if not frame:  # an empty frame marks the end
                return
            yield frame

    def _on_created(self) -> None:
        if not self._created.done():
            self._created.set_result(None)

    def _wake(self, ended: bool) -> None:
        with self._room:
            self._ended = self._ended or ended
            self._room.notify_all()

    async def finish(self, frames: list[Frame]) -> None:
        if self._refused is None:
            for frame in [*frames, b""]:
                self._add(frame)
        try:
            await self._task
        except asyncio.CancelledError:
            if self._refused is None:
                raise
        if self._refused is not None:
            raise self._refused

    async def abort(self, reason: str) -> None:
        self._wake(ended=True)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
