"""``pull``: read one blob out of a remote store over ``streams`` TCP connections striped by chunk.

Pipeline of one attempt: each stripe connection receives its chunks (``Get`` with ``stride``/``offset``) straight into
their final place: the reader's payload arena (``buffers``: reused, page-touched memory, one per blob,
``max_inflight_kv`` of them in the role's ``TransferContext``), where chunk ``i`` sits at ``i × chunk_size`` and the
layers' tensors end up as views — the kernel's copy is the only one. One feeder verifies the chunks (xxHash64, once per
byte) and feeds them to the ``BlobReader`` in chunk order on a worker thread while the event loop keeps receiving.
Memory is the blob's own arena, so a stripe may run ahead of the feeder without holding anything extra. A reader that
cannot take an arena (one already under way) gets each chunk in a fresh buffer, copied into its layers. A stripe that
fails ends the attempt; the next attempt resumes every stripe from ``reader.next_chunk`` (the last verified chunk) on
new connections, overwriting whatever unverified chunks the failed one left in the arena.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl as ssl_module
import time
from collections.abc import Callable

from prfaas.errors import KVBadFormat, KVCorrupt, KVIncompatible, KVTimeout, KVTruncated, KVUnavailable, PrfaasError
from prfaas.kv.format import BlobReader, parse_trailer
from prfaas.kv.state import KVState, LayerState
from prfaas.transfer import protocol as p
from prfaas.transfer import stats
from prfaas.transfer.conn import close, connect, mapped
from prfaas.transfer.context import TransferContext
from prfaas.transfer.tcp import tcp_info
from prfaas.transfer.wire import Conn

log = logging.getLogger(__name__)
RESUMABLE = (KVTimeout, KVCorrupt, KVTruncated, KVUnavailable)
BACKOFF_S, BACKOFF_CAP_S = 0.05, 2.0
BATCH = 8  # at most this many consecutive received chunks verified per hand-off to a worker

LayersCallback = Callable[[list[LayerState]], None]


def backoff(attempt: int, base_s: float = BACKOFF_S) -> float:
    """Exponential backoff with jitter before retry number ``attempt`` (1, 2, …): half to all of
    ``base_s × 2^(attempt-1)``, capped at ``BACKOFF_CAP_S``."""
    import random

    return min(BACKOFF_CAP_S, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


async def pull(address: str, kv_id: str, reader: BlobReader, *, timeout_s: float, retries: int = 2,
               ssl: ssl_module.SSLContext | None = None, on_layers: LayersCallback | None = None,
               backoff_s: float = BACKOFF_S, on_retry: Callable[[int, PrfaasError], None] | None = None,
               streams: int = 1, deadline_s: float | None = None,
               context: TransferContext | None = None) -> KVState:
    """Read blob ``kv_id`` from the store at ``address`` into ``reader`` (the caller owns it) and return the
    verified state; every frame is checked against ``reader.limits``. ``streams`` connections share the chunks. A
    reset, a stall past ``timeout_s`` (one chunk's wait), a corrupt chunk (never used: fetched again) or a truncated
    stream resumes from ``reader.next_chunk`` on new connections, after exponential backoff with jitter, at most
    ``retries`` times and only while the role's retry cap allows (``context.stats``); then the last error is raised.
    ``KVNotFound``, ``KVExpired``, ``KVBadFormat``, ``KVIncompatible`` and ``KVTooLarge`` are raised at once.
    ``deadline_s`` bounds the whole pull (``KVTimeout``; see ``stats.blob_deadline_s``). ``context`` is the role's
    (``prfaas.transfer.context``: client TLS when ``ssl`` is not given, ``max_inflight_kv``, arenas, verify threads,
    stats); without one the call gets a fresh one of its own. ``on_layers`` gets layers as they complete;
    ``on_retry`` is told each retry. No task, socket or buffer outlives the call. Chunks are received into a reused
    arena (``context.arenas``) that the returned state's tensors are views of; it is reused once the caller drops
    the state and ``reader``."""
    ctx = context or TransferContext()
    recorder = ctx.stats.pull
    if reader.retain and reader.arena is None and not reader.next_chunk:
        with contextlib.suppress(OSError):  # no mapping that large (strict overcommit): the reader copies instead
            reader.use_arena(ctx.arenas.take(reader.max_bytes))
    async with stats.maybe_slot(ctx.inflight):
        recorder.started()
        start = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                state = await _attempts(address, kv_id, reader, timeout_s, retries, ssl or ctx.client_ssl,
                                        on_layers, backoff_s, on_retry, max(1, streams), ctx)
        except TimeoutError as exc:
            recorder.finished(False, time.perf_counter() - start, 0, KVTimeout.code)
            raise KVTimeout(f"pull {kv_id}: blob deadline of {deadline_s:.3f} s passed") from exc
        except PrfaasError as exc:
            recorder.finished(False, time.perf_counter() - start, 0, exc.code)
            raise
        recorder.finished(True, time.perf_counter() - start, state.nbytes)
        return state


async def _attempts(address: str, kv_id: str, reader: BlobReader, timeout_s: float, retries: int,
                    ssl: ssl_module.SSLContext | None, on_layers: LayersCallback | None, backoff_s: float,
                    on_retry: Callable[[int, PrfaasError], None] | None, streams: int,
                    ctx: TransferContext) -> KVState:
    attempt = 0
    while True:
        try:
            await _Attempt(address, kv_id, reader, timeout_s, ssl, on_layers, streams, ctx).run()
            return reader.state()
        except RESUMABLE as exc:
            if attempt >= retries or not ctx.stats.pull.allow_retry(exc.code):
                raise
            attempt += 1
            log.info("pull %s: %s; retry %d/%d from chunk %d", kv_id, exc.code, attempt, retries,
                     reader.next_chunk)
            if on_retry is not None:
                on_retry(attempt, exc)
            await asyncio.sleep(backoff(attempt, backoff_s))


class _Attempt:
    """One try: ``streams`` stripe tasks and one feeder; the first failure cancels the rest."""

    def __init__(self, address: str, kv_id: str, reader: BlobReader, timeout_s: float,
                 ssl: ssl_module.SSLContext | None, on_layers: LayersCallback | None, streams: int,
                 ctx: TransferContext) -> None:
        self.address, self.kv_id, self.reader, self.timeout_s, self.ssl = address, kv_id, reader, timeout_s, ssl
        self.on_layers, self.streams, self.ctx = on_layers, streams, ctx
        self.base = reader.next_chunk
        self.ready: dict[int, tuple[memoryview, int]] = {}
        self.trailer: bytes | bytearray | memoryview | None = None
        self.changed = asyncio.Event()
        self.draining = False

    async def run(self) -> None:
        stripes = [asyncio.create_task(self._stripe(s)) for s in range(self.streams)]
        feeder = asyncio.create_task(self._feed())
        try:
            done, _ = await asyncio.wait([*stripes, feeder], return_when=asyncio.FIRST_EXCEPTION)
            failed = [t.exception() for t in done if t.exception() is not None]
            if failed:
                if feeder not in done:  # a connection failed: keep what already arrived in order, then resume
                    await self._drain(stripes, feeder)
                raise failed[0]  # type: ignore[misc]
        finally:
            for task in [*stripes, feeder]:
                task.cancel()
            await asyncio.gather(*stripes, feeder, return_exceptions=True)

    async def _drain(self, stripes: list[asyncio.Task[None]], feeder: asyncio.Task[None]) -> None:
        for task in stripes:
            task.cancel()
        await asyncio.gather(*stripes, return_exceptions=True)
        self.draining = True
        self.changed.set()
        await asyncio.gather(feeder, return_exceptions=True)  # a chunk that fails here is simply fetched again

    async def _stripe(self, offset: int) -> None:
        recorder = self.ctx.stats.pull
        conn = await connect(self.address, self.ssl, self.timeout_s, recorder.bandwidth_bps() / self.streams,
                             recorder.rtt_us / 1e6 or None)
        try:
            with mapped(f"pull {self.kv_id}"):
                await self._receive(conn, offset)
        finally:
            recorder.connection(_info(conn), peer=self.address)
            await close(conn)

    async def _receive(self, conn: Conn, offset: int) -> None:
        get = p.Get(self.kv_id, self.base, max(1, int(self.timeout_s * 1000)), self.streams, offset)
        async with asyncio.timeout(self.timeout_s):
            await conn.sendall(p.encode(get))
            p.expect(await p.read_message(conn, self.reader.limits), p.Ok)
            first = await p.read_frame(conn, max_chunk=0, limits=self.reader.limits)
        self._check_header(first)
        assert self.reader.header is not None
        size, expected = self.reader.header.chunk_size, self.base + offset
        while True:
            async with asyncio.timeout(self.timeout_s):  # a chunk lands where chunk ``expected`` belongs
                frame = await p.read_frame(conn, size, functools.partial(self.reader.chunk_view, expected),
                                         self.reader.limits)
            if frame.tag == b"C":
                if frame.index != expected:
                    raise KVBadFormat(f"chunk {frame.index} arrived where chunk {expected} was due")
                self.ready[frame.index] = (memoryview(frame.data), frame.checksum)
                self.changed.set()
                expected += self.streams
                continue
            if frame.tag == b"T":
                parse_trailer(frame.whole, self.reader.limits)
                self.trailer = frame.whole
                self.changed.set()
                return
            if isinstance(frame.message, p.Error):
                raise frame.message.exception()  # the server gave up mid-stream (expired, aborted, stalled)
            raise KVBadFormat(f"unexpected {frame.tag!r} frame inside a blob")

    def _check_header(self, first: p.Frame) -> None:
        if first.tag != b"P":
            raise KVBadFormat(f"blob {self.kv_id} did not start with its header frame")
        self.reader.resume_header(first.whole)
        assert self.reader.header is not None
        if self.reader.header.kv_id != self.kv_id:
            raise KVIncompatible(f"asked for blob {self.kv_id}, got {self.reader.header.kv_id}")

    async def _feed(self) -> None:
        """Verify and use chunks in order; a chunk that fails a check leaves ``reader`` as it was."""
        loop = asyncio.get_running_loop()
        while not self.reader.done:
            index = self.reader.next_chunk
            item = self.ready.pop(index, None)
            if item is not None:
                batch = [(index, *item)]  # with the chunks right after it that are in too: one hand-off
                while len(batch) < BATCH and (more := self.ready.pop(index + len(batch), None)) is not None:
                    batch.append((index + len(batch), *more))
                job = _Job(self.reader, batch)
                del batch, item
                work = loop.run_in_executor(self.ctx.verify, job)
                try:
                    await asyncio.shield(work)
                except asyncio.CancelledError:
                    await asyncio.wait([work])  # the reader must not change after this attempt has ended
                    raise
                layers, job.layers, error, job.error = job.layers, [], job.error, None
                if layers and self.on_layers is not None:
                    self.on_layers(layers)
                if error is not None:
                    raise error
            elif self.trailer is not None and parse_trailer(self.trailer, self.reader.limits).chunk_count == index:
                layers = self.reader.feed(self.trailer)
                if layers and self.on_layers is not None:
                    self.on_layers(layers)
            elif self.draining:
                return
            else:
                self.changed.clear()
                await self.changed.wait()


class _Job:
    """``feed_chunk`` for a run of consecutive chunks, on a verify worker; it holds nothing of the blob once it has
    run: the worker thread drops its last references to a job only after the event loop has moved on, and an arena
    is reused only when nothing refers to it (``buffers``). The layers it completed wait in ``layers`` for the
    feeder, and the error that stopped it (the chunks before it were used, the rest were not) in ``error``."""

    def __init__(self, reader: BlobReader, chunks: list[tuple[int, memoryview, int]]) -> None:
        self.call: tuple[BlobReader, list[tuple[int, memoryview, int]]] | None = (reader, chunks)
        self.layers: list[LayerState] = []
        self.error: PrfaasError | None = None

    def __call__(self) -> None:
        assert self.call is not None
        reader, chunks = self.call
        self.call = None
        try:
            for index, data, checksum in chunks:
                self.layers += reader.feed_chunk(index, data, checksum)
        except PrfaasError as exc:
            self.error = exc.with_traceback(None)
        finally:
            del reader, chunks


def _info(conn: Conn) -> stats.TcpInfo | None:
    with contextlib.suppress(Exception):
        return tcp_info(conn.sock)
    return None
