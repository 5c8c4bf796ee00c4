"""``BlobStore``: KV blobs in memory, kept as the frames they travel in, with TTL, a byte budget and LRU eviction.

Ownership: the writer (prefill, or the transfer server on its behalf) owns a blob from ``create`` until ``finish``
(or ``abort``); from then on the store owns it until decode's ``release``, its TTL (counted from creation), LRU
eviction under budget pressure, or ``close``. Every blob ends in exactly one ``DeletionRecord``.

The store is thread-safe (one lock); ``frames`` must run in an event loop and may be consumed from any number of
loops. Writers over budget get ``KVStoreFull`` (never an unbounded allocation); only ready blobs that nobody is
reading are evicted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable

import xxhash

from prfaas.errors import (
    InvalidRequest,
    KVBadFormat,
    KVCorrupt,
    KVStoreFull,
    KVTimeout,
    KVTruncated,
    KVUnavailable,
)
from prfaas.kv.format import CHUNK_HEAD_SIZE, parse_chunk_head, parse_header, parse_trailer
from prfaas.store.blob import Blob
from prfaas.store.records import (
    ABORTED,
    EVICTED,
    EXPIRED,
    REASONS,
    RELEASED,
    SHUTDOWN,
    DeletionRecord,
    StoreStats,
    gone_error,
)

log = logging.getLogger(__name__)
GONE_MEMORY = 65536  # ended kv_ids remembered, so a late reader learns why (KV_EXPIRED vs KV_NOT_FOUND)
MAX_RECORDS = 100_000  # kept in ``records``; the durable copy is whatever ``on_delete`` writes


class BlobStore:
    """Holds blobs as the frames they travel in. State: writing -> ready -> (released | expired | evicted |
    aborted); ``close`` ends what is left as ``shutdown``. ``on_delete`` is called (under the store's lock, so
    keep it short and do not call back into the store from another thread) with each record."""

    def __init__(self, budget_bytes: int, ttl_s: float, on_delete: Callable[[DeletionRecord], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        if budget_bytes <= 0 or ttl_s <= 0:
            raise InvalidRequest("store budget and TTL must be positive")
        self.budget_bytes, self.ttl_s = budget_bytes, ttl_s
        self.on_delete, self._clock, self._wall = on_delete, clock, wall
        self.records: list[DeletionRecord] = []
        self._live: OrderedDict[str, Blob] = OrderedDict()  # least recently used first
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._bytes = self._deleted = 0
        self._closed = False
        self._lock = threading.RLock()

    # -- writer side -------------------------------------------------------------------------------------------

    def create(self, kv_id: str, header_frame: bytes) -> None:
        """Start a blob (state writing). ``InvalidRequest`` if ``kv_id`` is live or was used before,
        ``KVBadFormat``/``KVCorrupt`` for a bad header frame or one naming another id, ``KVStoreFull`` when even
        evicting idle ready blobs leaves no room, ``KVUnavailable`` after ``close``."""
        try:
            header, frame = parse_header(header_frame)
        except KVTruncated as exc:
            raise KVBadFormat(f"incomplete header frame for {kv_id}") from exc
        if header.kv_id != kv_id:
            raise KVBadFormat(f"header frame names {header.kv_id}, not {kv_id}")
        with self._lock:
            if self._closed:
                raise KVUnavailable("KV store is shut down")
            if kv_id in self._live or self._gone.get(kv_id, ABORTED) != ABORTED:
                raise InvalidRequest(f"kv_id {kv_id} already exists in this store")
            self._gone.pop(kv_id, None)
            self._make_room(len(frame))
            blob = Blob(kv_id, frame, header.chunk_size, self._clock(), int(self._wall() * 1000))
            self._live[kv_id] = blob
            self._grow(blob, len(frame))

    def append(self, kv_id: str, chunk_frame: bytes) -> None:
        """Add the next chunk frame (head + data, verified here). ``KVBadFormat`` if out of order or over the
        chunk size, ``KVCorrupt`` on a checksum mismatch, ``KVStoreFull`` over budget (the blob stays writing: the
        writer may retry or ``abort``), ``KVNotFound``/``KVExpired`` if the blob has ended."""
        index, length, checksum = parse_chunk_head(chunk_frame[:CHUNK_HEAD_SIZE])
        data = memoryview(chunk_frame)[CHUNK_HEAD_SIZE:]
        if len(data) != length or xxhash.xxh64_intdigest(data) != checksum:
            raise KVCorrupt(f"chunk {index} of {kv_id} failed its length or xxHash64 check")
        with self._lock:
            blob = self._writing(kv_id)
            if index != len(blob.chunks) or length > blob.chunk_size:
                raise KVBadFormat(f"chunk {index} ({length} bytes) out of order or over the chunk size")
            self._make_room(len(chunk_frame))
            blob.chunks.append(chunk_frame)
            blob.payload += length
            self._grow(blob, len(chunk_frame))

    def finish(self, kv_id: str, trailer_frame: bytes) -> None:
        """Close the blob with its trailer (state ready); the store owns it from now on. ``KVCorrupt`` if the
        trailer disagrees with the chunks received. The few trailer bytes are never refused for budget."""
        trailer = parse_trailer(trailer_frame)
        with self._lock:
            blob = self._writing(kv_id)
            if trailer.chunk_count != len(blob.chunks) or trailer.total_bytes != blob.payload:
                raise KVCorrupt(f"trailer of {kv_id} says {trailer.chunk_count} chunks / {trailer.total_bytes} "
                                f"bytes; the store holds {len(blob.chunks)} / {blob.payload}")
            blob.trailer, blob.payload_xxh64 = bytes(trailer_frame), trailer.payload_xxh64
            self._grow(blob, len(trailer_frame))

    def abort(self, kv_id: str, reason: str = ABORTED) -> DeletionRecord:
        """The writer failed: the blob ends now, readers get ``KV_TRUNCATED``. ``KVNotFound``/``KVExpired`` if
        it has already ended."""
        with self._lock:
            return self._end(self._lookup(kv_id), reason if reason in REASONS else ABORTED)

    # -- reader side -------------------------------------------------------------------------------------------

    async def frames(self, kv_id: str, from_chunk: int = 0, timeout_s: float = 5.0) -> AsyncGenerator[bytes, None]:
        """Yield the header frame, the chunk frames from ``from_chunk`` on (waiting for chunks still being
        written) and the trailer frame. Re-reads are idempotent until release. Errors: ``KVNotFound`` (unknown,
        released, evicted), ``KVExpired``, ``KVTruncated`` (aborted), ``KVTimeout`` (no new chunk within
        ``timeout_s``), ``KVUnavailable`` (store closed), ``InvalidRequest`` (``from_chunk`` past the end)."""
        blob = self._open(kv_id, from_chunk)
        try:
            yield blob.header
            index = from_chunk
            while True:
                step = self._next(blob, index)
                if isinstance(step, asyncio.Future):
                    await self._wait(blob, step, timeout_s)
                    continue
                frame, last = step
                yield frame
                if last:
                    return
                index += 1
        finally:
            self._close_reader(blob)

    def release(self, kv_id: str) -> DeletionRecord:
        """Decode's acknowledgement: delete the blob now and record it. ``KVNotFound`` if unknown or already gone
        (``KVExpired`` if its TTL passed first)."""
        with self._lock:
            return self._end(self._lookup(kv_id), RELEASED)

    # -- housekeeping ------------------------------------------------------------------------------------------

    def sweep(self) -> list[DeletionRecord]:
        """Expire every blob whose TTL (from creation) has passed, readers or not; call periodically."""
        with self._lock:
            old = [b for b in self._live.values() if self._expired(b)]
            return [self._end(b, EXPIRED) for b in old]

    def close(self) -> list[DeletionRecord]:
        """Shutdown: every remaining blob ends with a ``shutdown`` record; later writes get ``KVUnavailable``."""
        with self._lock:
            self._closed = True
            return [self._end(b, SHUTDOWN) for b in list(self._live.values())]

    def stats(self) -> StoreStats:
        with self._lock:
            blobs = list(self._live.values())
            return StoreStats(blobs=len(blobs), bytes=self._bytes, budget_bytes=self.budget_bytes,
                              writing=sum(b.trailer is None for b in blobs),
                              ready=sum(b.trailer is not None for b in blobs),
                              readers=sum(b.readers for b in blobs), deleted=self._deleted)

    # -- internals ---------------------------------------------------------------------------------------------

    def _lookup(self, kv_id: str) -> Blob:
        blob = self._live.get(kv_id)
        if blob is not None and self._expired(blob):
            self._end(blob, EXPIRED)
            blob = None
        if blob is None:
            raise gone_error(kv_id, self._gone.get(kv_id))
        return blob

    def _writing(self, kv_id: str) -> Blob:
        blob = self._lookup(kv_id)
        if blob.trailer is not None:
            raise InvalidRequest(f"KV blob {kv_id} is already finished")
        return blob

    def _expired(self, blob: Blob) -> bool:
        return self._clock() - blob.created >= self.ttl_s

    def _make_room(self, need: int) -> None:
        """Evict least recently used ready blobs nobody is reading until ``need`` more bytes fit."""
        if need > self.budget_bytes:
            raise KVStoreFull(f"{need} bytes is more than the whole store budget ({self.budget_bytes})")
        idle = [b for b in self._live.values() if b.trailer is not None and b.readers == 0]
        while self._bytes + need > self.budget_bytes and idle:
            self._end(idle.pop(0), EVICTED)
        if self._bytes + need > self.budget_bytes:
            raise KVStoreFull(f"KV store over budget: {self._bytes} + {need} > {self.budget_bytes} bytes")

    def _grow(self, blob: Blob, n: int) -> None:
        blob.nbytes += n
        self._bytes += n
        blob.wake()

    def _end(self, blob: Blob, reason: str) -> DeletionRecord:
        del self._live[blob.kv_id]
        self._gone[blob.kv_id] = reason
        while len(self._gone) > GONE_MEMORY:
            self._gone.popitem(last=False)
        self._bytes -= blob.nbytes
        self._deleted += 1
        blob.ended = reason
        record = DeletionRecord(blob.kv_id, reason, blob.nbytes, len(blob.chunks), blob.payload_xxh64,
                                blob.created_ms, int(self._wall() * 1000))
        blob.chunks, blob.trailer = [], None  # readers still holding the blob must not keep its memory alive
        blob.wake()
        self.records.append(record)
        if len(self.records) > MAX_RECORDS:
            del self.records[:MAX_RECORDS // 2]
        if self.on_delete is not None:
            try:
                self.on_delete(record)
            except Exception:
                log.exception("on_delete callback failed for %s", blob.kv_id)
        return record

    def _open(self, kv_id: str, from_chunk: int) -> Blob:
        with self._lock:
            blob = self._lookup(kv_id)
            if from_chunk < 0 or (blob.trailer is not None and from_chunk > len(blob.chunks)):
                raise InvalidRequest(f"from_chunk {from_chunk} is outside blob {kv_id}")
            blob.readers += 1
            self._live.move_to_end(kv_id)
            return blob

    def _close_reader(self, blob: Blob) -> None:
        with self._lock:
            blob.readers -= 1
            if blob.kv_id in self._live and blob.ended is None:
                self._live.move_to_end(blob.kv_id)

    def _next(self, blob: Blob, index: int) -> tuple[bytes, bool] | asyncio.Future[None]:
        """``(frame, is_trailer)`` for chunk ``index`` (or the trailer after the last chunk), or a future that is
        set when the blob changes."""
        with self._lock:
            if blob.ended is None and self._expired(blob):
                self._end(blob, EXPIRED)
            if blob.ended is not None:
                raise gone_error(blob.kv_id, blob.ended)
            if index < len(blob.chunks):
                return blob.chunks[index], False
            if blob.trailer is not None:
                return blob.trailer, True
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            blob.waiters.append((loop, future))
            return future

    async def _wait(self, blob: Blob, future: asyncio.Future[None], timeout_s: float) -> None:
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError as exc:
            raise KVTimeout(f"no new chunk of {blob.kv_id} within {timeout_s:.3f} s") from exc
        finally:
            with self._lock:
                blob.waiters = [w for w in blob.waiters if w[1] is not future]
