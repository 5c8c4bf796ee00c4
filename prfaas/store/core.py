"""``BlobStore``: KV blobs kept as the frames they travel in, with TTL, a byte budget, LRU eviction, one deletion
record per blob and one access record per create, finish, read, release and abort.

Ownership: the writer (prefill, or the transfer server on its behalf) owns a blob from ``create`` until ``finish``
(or ``abort``); from then on the store owns it until decode's ``release`` (or the router's, for an abandoned
request), its TTL (counted from creation), LRU eviction under budget pressure, or ``close``. Every blob ends in
exactly one ``DeletionRecord``.

The store is thread-safe (one lock); ``frames`` must run in an event loop and may be consumed from any number of
loops. Writers over budget get ``KVStoreFull`` (never an unbounded allocation); only ready blobs that nobody is
reading are evicted. Where the frames live is the ``backend``'s business (memory or Redis); the rules are here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterator

from prfaas import records as r
from prfaas.errors import InvalidRequest, KVStoreFull, KVTimeout, KVUnavailable, PrfaasError
from prfaas.limits import DEFAULT as DEFAULT_LIMITS
from prfaas.limits import WireLimits
from prfaas.records import DeletionRecord, LiveBlob, StoreStats, gone_error
from prfaas.store import access, checks
from prfaas.store.backend import HEADER, TRAILER, FrameBackend, MemoryBackend
from prfaas.store.blob import Blob
from prfaas.store.ledger import Ledger, OnAccess, OnDelete, Tally

log = logging.getLogger(__name__)
GONE_MEMORY = 65536  # ended kv_ids remembered, so a late reader learns why (KV_EXPIRED vs KV_NOT_FOUND)


class BlobStore:
    """Holds blobs. State: writing -> ready -> (released | expired | evicted | aborted); ``close`` ends what is
    left as ``shutdown``. ``on_delete`` gets each ``DeletionRecord`` (under the store's lock: keep it short and
    never call back into the store); ``on_access`` each ``AccessRecord``. ``owner`` is recorded as who made a
    local call when no ``prfaas.store.access.accessing`` block names someone else. A blob's own TTL (a Put's
    ``ttl_ms``, a tenant's override) may shorten or lengthen ``ttl_s`` up to ``max_ttl_s`` (default ``ttl_s``);
    a longer one is cut to it, so no writer can keep a blob beyond what the configuration allows, and a writer
    whose tenant policy this store lacks still gets its blob stored. ``limits``: the wire limits a writer's
    frames are checked against (the role's ``config.limits``; the defaults when none are given)."""

    def __init__(self, budget_bytes: int, ttl_s: float, on_delete: OnDelete | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time, *,
                 backend: FrameBackend | None = None, on_access: OnAccess | None = None,
                 owner: str = "local", max_ttl_s: float = 0.0, limits: WireLimits = DEFAULT_LIMITS) -> None:
        if budget_bytes <= 0 or ttl_s <= 0 or max_ttl_s < 0:
            raise InvalidRequest("store budget and TTL must be positive")
        self.budget_bytes, self.ttl_s, self._clock, self._wall = budget_bytes, ttl_s, clock, wall
        self.max_ttl_s = max(max_ttl_s, ttl_s)  # the longest a blob may ask to live (a tenant's override)
        self.backend: FrameBackend = backend or MemoryBackend()
        self._ledger = Ledger(owner, on_delete, on_access, wall)
        self._live: OrderedDict[str, Blob] = OrderedDict()  # least recently used first
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self._closed = False
        self._lock = threading.RLock()
        self.limits = limits
        self._adopt()

    @property
    def records(self) -> list[DeletionRecord]:
        """The most recent deletion records (bounded); the durable copy is the audit log."""
        return self._ledger.records

    # -- writer side -------------------------------------------------------------------------------------------

    def create(self, kv_id: str, header_frame: bytes, ttl_s: float = 0.0) -> None:
        """Start a blob (state writing), owned by the tenant of the current ``accessing`` block, with its own
        ``ttl_s`` when given (else the store's). ``InvalidRequest`` if ``kv_id`` is live or was used before, or
        ``ttl_s`` is negative (one over ``max_ttl_s`` is cut to it); ``KVBadFormat``/``KVCorrupt`` for a bad header
        frame or one naming another id,
        ``KVStoreFull`` when even evicting idle ready blobs leaves no room, ``KVUnavailable`` after ``close`` or
        when the backend is down."""
        with self._audit(r.CREATE, kv_id, len(header_frame)):
            header, frame = checks.header(kv_id, header_frame, self.limits)
            if ttl_s < 0:
                raise InvalidRequest(f"blob TTL must be positive, not {ttl_s}")
            if ttl_s > self.max_ttl_s:  # a TTL comes off the wire: never let a writer pin memory past the config
                log.warning("blob %s asked for a TTL of %g s; kept for this store's longest, %g s", kv_id, ttl_s,
                            self.max_ttl_s)
                ttl_s = self.max_ttl_s
            with self._lock:
                self._check_new(kv_id)
                self._make_room(len(frame))
                blob = Blob(kv_id, header.chunk_size, self._clock(), self._ledger.now_ms(), nbytes=len(frame),
                            tenant=access.current().tenant, ttl_s=ttl_s)
                self.backend.start(blob.meta(), frame, ttl_s or self.ttl_s)
                self._gone.pop(kv_id, None)
                self._live[kv_id] = blob
                self._bytes += len(frame)

    def append(self, kv_id: str, chunk_frame: bytes) -> None:
        """Add the next chunk frame (head + data, verified here). ``KVBadFormat`` if out of order or over the
        chunk size, ``KVCorrupt`` on a checksum mismatch, ``KVStoreFull`` over budget (the blob stays writing: the
        writer may retry or ``abort``), ``KVNotFound``/``KVExpired`` if the blob has ended."""
        index, length = checks.chunk(kv_id, chunk_frame, self.limits)
        with self._lock:
            blob = self._writing(kv_id)
            checks.in_order(blob, index, length)
            self._make_room(len(chunk_frame))
            blob.chunks, blob.payload, blob.nbytes = blob.chunks + 1, blob.payload + length, blob.nbytes + len(
                chunk_frame)
            self._store(blob, index, chunk_frame, len(chunk_frame))

    def finish(self, kv_id: str, trailer_frame: bytes) -> None:
        """Close the blob with its trailer (state ready); the store owns it from now on. ``KVCorrupt`` if the
        trailer disagrees with the chunks received. The few trailer bytes are never refused for budget."""
        with self._lock, self._audit(r.FINISH, kv_id, 0) as sizes:
            blob = self._writing(kv_id)
            sizes.tenant = blob.tenant
            blob.ready, blob.payload_xxh64 = True, checks.trailer(blob, trailer_frame, self.limits).payload_xxh64
            blob.nbytes += len(trailer_frame)
            self._store(blob, TRAILER, bytes(trailer_frame), len(trailer_frame))
            sizes.bytes = blob.nbytes

    def abort(self, kv_id: str, reason: str = r.ABORTED) -> DeletionRecord:
        """The writer failed: the blob ends now, readers get ``KV_TRUNCATED``. ``KVNotFound``/``KVExpired`` if
        it has already ended."""
        with self._lock, self._audit(r.ABORT, kv_id, 0) as sizes:
            blob = self._lookup(kv_id)
            sizes.bytes, sizes.tenant = blob.nbytes, blob.tenant
            return self._end(blob, reason if reason in r.REASONS else r.ABORTED)

    # -- reader side -------------------------------------------------------------------------------------------

    async def frames(self, kv_id: str, from_chunk: int = 0, timeout_s: float = 5.0) -> AsyncGenerator[bytes, None]:
        """Yield the header frame, the chunk frames from ``from_chunk`` on (waiting for chunks still being
        written) and the trailer frame. Re-reads are idempotent until release. Errors: ``KVNotFound`` (unknown,
        released, evicted), ``KVExpired``, ``KVTruncated`` (aborted), ``KVTimeout`` (no new chunk within
        ``timeout_s``), ``KVUnavailable`` (store closed), ``InvalidRequest`` (``from_chunk`` past the end).
        An error mid-blob ends the stream: a reader never gets a blob with frames missing."""
        with self._audit(r.READ, kv_id, 0, outcome="incomplete") as served:  # until the trailer is out
            blob, header = self._open(kv_id, from_chunk)
            served.tenant = blob.tenant
            try:
                served.bytes += len(header)
                yield header
                index = from_chunk
                while True:
                    step = self._next(blob, index)
                    if isinstance(step, asyncio.Future):
                        await self._wait(blob, step, timeout_s)
                        continue
                    frame, last = step
                    served.bytes += len(frame)
                    if last:
                        served.outcome = r.OK
                    yield frame
                    if last:
                        return
                    index += 1
            finally:
                self._close_reader(blob)

    def release(self, kv_id: str) -> DeletionRecord:
        """The consumer's acknowledgement (decode, or the router for an abandoned request): delete the blob now,
        whatever its state, and record it. ``KVNotFound`` if unknown or already gone (``KVExpired`` if its TTL
        passed first)."""
        with self._lock, self._audit(r.RELEASE, kv_id, 0) as sizes:
            blob = self._lookup(kv_id)
            sizes.bytes, sizes.tenant = blob.nbytes, blob.tenant
            return self._end(blob, r.RELEASED)

    # -- housekeeping ------------------------------------------------------------------------------------------

    def sweep(self) -> list[DeletionRecord]:
        """Expire every blob whose TTL (from creation) has passed, readers or not; call periodically."""
        with self._lock:
            old = [b for b in self._live.values() if self._expired(b)]
            return [self._end(b, r.EXPIRED) for b in old]

    def close(self) -> list[DeletionRecord]:
        """Shutdown: every remaining blob ends with a ``shutdown`` record (and leaves the backend); later writes
        get ``KVUnavailable``."""
        with self._lock:
            self._closed = True
            left = [self._end(b, r.SHUTDOWN) for b in list(self._live.values())]
            self.backend.close()
            return left

    def stats(self) -> StoreStats:
        with self._lock:
            blobs = list(self._live.values())
            return StoreStats(blobs=len(blobs), bytes=self._bytes, budget_bytes=self.budget_bytes,
                              writing=sum(not b.ready for b in blobs), ready=sum(b.ready for b in blobs),
                              readers=sum(b.readers for b in blobs), deleted=self._ledger.deleted)

    def live(self) -> list[LiveBlob]:
        """Every live blob, least recently used first (``/debug/store``, leak checks)."""
        with self._lock:
            now = self._clock()
            return [b.live(now) for b in self._live.values()]

    # -- internals ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _audit(self, action: str, kv_id: str, nbytes: int, outcome: str = r.OK) -> Iterator[Tally]:
        """One access record for the block; its ``Tally`` may be updated inside; an error's code wins."""
        tally = Tally(nbytes, outcome)
        try:
            yield tally
        except PrfaasError as exc:
            tally.outcome = exc.code
            raise
        finally:
            self._ledger.access(action, kv_id, tally.bytes, tally.outcome, tally.tenant)

    def _check_new(self, kv_id: str) -> None:
        if self._closed:
            raise KVUnavailable("KV store is shut down")
        if kv_id in self._live or self._gone.get(kv_id, r.ABORTED) != r.ABORTED:
            raise InvalidRequest(f"kv_id {kv_id} already exists in this store")

    def _lookup(self, kv_id: str) -> Blob:
        blob = self._live.get(kv_id)
        if blob is not None and self._expired(blob):
            self._end(blob, r.EXPIRED)
            blob = None
        if blob is None:
            raise gone_error(kv_id, self._gone.get(kv_id))
        return blob

    def _writing(self, kv_id: str) -> Blob:
        blob = self._lookup(kv_id)
        if blob.ready:
            raise InvalidRequest(f"KV blob {kv_id} is already finished")
        return blob

    def _expired(self, blob: Blob) -> bool:
        return self._clock() - blob.created >= (blob.ttl_s or self.ttl_s)

    def _make_room(self, need: int) -> None:
        """Evict least recently used ready blobs nobody is reading until ``need`` more bytes fit."""
        if need > self.budget_bytes:
            raise KVStoreFull(f"{need} bytes is more than the whole store budget ({self.budget_bytes})")
        idle = [b for b in self._live.values() if b.ready and b.readers == 0]
        while self._bytes + need > self.budget_bytes and idle:
            self._end(idle.pop(0), r.EVICTED)
        if self._bytes + need > self.budget_bytes:
            raise KVStoreFull(f"KV store over budget: {self._bytes} + {need} > {self.budget_bytes} bytes; "
                              f"retry after back-off")

    def _store(self, blob: Blob, slot: int, frame: bytes, n: int) -> None:
        """Put a frame whose bytes are already counted in ``blob``; a backend that lost the blob ends it."""
        self._bytes += n
        if not self.backend.put(blob.meta(), slot, frame):
            self._lost(blob)
        blob.wake()

    def _lost(self, blob: Blob) -> None:
        """The backend dropped the blob on its own (its TTL or memory policy): end it and tell the caller."""
        reason = r.EXPIRED if self._expired(blob) else r.EVICTED
        self._end(blob, reason)
        raise gone_error(blob.kv_id, reason)

    def _end(self, blob: Blob, reason: str) -> DeletionRecord:
        del self._live[blob.kv_id]
        self._gone[blob.kv_id] = reason
        while len(self._gone) > GONE_MEMORY:
            self._gone.popitem(last=False)
        self._bytes -= blob.nbytes
        blob.ended = reason
        try:
            self.backend.drop(blob.kv_id)
        except PrfaasError as exc:  # the backend's own TTL deletes it later; the record stands
            log.warning("could not drop %s from the %s backend: %s", blob.kv_id, self.backend.name, exc)
        blob.wake()
        return self._ledger.ended(blob, reason, key_destroyed=getattr(self.backend, "sealed", False))

    def _adopt(self) -> None:
        """Blobs a previous store left in the backend: ready ones live on (TTL from their creation), the rest end
        (``aborted``: their writer is gone; ``expired``)."""
        now, wall = self._clock(), self._wall()
        for meta in self.backend.leftovers():
            blob = Blob.adopt(meta, now - max(0.0, wall - meta.created_ms / 1000))
            self._live[blob.kv_id] = blob
            self._bytes += blob.nbytes
            if self._expired(blob) or not blob.ready:
                self._end(blob, r.EXPIRED if self._expired(blob) else r.ABORTED)
            else:
                log.info("adopted blob %s (%d bytes) left by a previous store", blob.kv_id, blob.nbytes)

    def _open(self, kv_id: str, from_chunk: int) -> tuple[Blob, bytes]:
        with self._lock:
            blob = self._lookup(kv_id)
            if from_chunk < 0 or (blob.ready and from_chunk > blob.chunks):
                raise InvalidRequest(f"from_chunk {from_chunk} is outside blob {kv_id}")
            header = self.backend.get(kv_id, HEADER)
            if header is None:
                self._lost(blob)
            blob.readers += 1
            self._live.move_to_end(kv_id)
            return blob, header  # type: ignore[return-value]

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
                self._end(blob, r.EXPIRED)
            if blob.ended is not None:
                raise gone_error(blob.kv_id, blob.ended)
            if index >= blob.chunks and not blob.ready:
                future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                blob.waiters.append((future.get_loop(), future))
                return future
            last = index >= blob.chunks
            frame = self.backend.get(blob.kv_id, TRAILER if last else index)
            if frame is None:
                self._lost(blob)
            return frame, last  # type: ignore[return-value]

    async def _wait(self, blob: Blob, future: asyncio.Future[None], timeout_s: float) -> None:
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError as exc:
            raise KVTimeout(f"no new chunk of {blob.kv_id} within {timeout_s:.3f} s") from exc
        finally:
            with self._lock:
                blob.waiters = [w for w in blob.waiters if w[1] is not future]
