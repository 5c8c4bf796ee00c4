"""Data-plane client: ``push`` a blob into a remote store, ``pull`` one out (``prfaas.transfer.pull``: striped,
resuming after failures), ``release`` it, ``stat`` the store. Every call opens its own connections and closes them
before returning, whatever happens. Frames are sent from their own memory (no concatenation).

Timeouts: ``timeout_s`` bounds each wait on the network — connecting, one reply, one frame (one chunk is one
"transfer" in the contract's sense). The caller bounds the whole blob: its deadline is chunk count × (chunk bytes
/ measured bandwidth) + ``kv_transfer_timeout_ms`` (docs/contracts.md), e.g. with ``asyncio.timeout`` around ``pull``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any

from prfaas.errors import KVTimeout, PrfaasError
from prfaas.kv.format import CHUNK_HEAD_SIZE, Frame
from prfaas.limits import WireLimits
from prfaas.records import DeletionRecord, StoreStats
from prfaas.transfer import protocol as p
from prfaas.transfer import stats, tcp
from prfaas.transfer.conn import close, connect, mapped
from prfaas.transfer.context import TransferContext
from prfaas.transfer.pull import backoff, pull
from prfaas.transfer.wire import Conn

__all__ = ["backoff", "pull", "push", "release", "stat"]

log = logging.getLogger(__name__)
EARLY_REPLY_S = 0.5


async def push(address: str, kv_id: str, frames: AsyncIterable[Frame] | Iterable[Frame], *,
               ssl: ssl_module.SSLContext | None = None, timeout_s: float, idle_s: float = 30.0,
               deadline_s: float | None = None, tenant: str = "", ttl_s: float = 0.0,
               on_created: Callable[[], None] | None = None, context: TransferContext | None = None) -> None:
    """Stream blob ``kv_id`` (its frames: header, chunks, trailer) into the store at ``address`` as ``frames``
    yields them; returns once the store holds the whole blob, kept for ``tenant`` (its records say so) for
    ``ttl_s`` (0: the store's TTL). ``timeout_s`` bounds each network wait; ``idle_s``
    is how long the server waits for the next frame (the producer's pace). On failure the server aborts the
    blob (no partial blob is left) and its error (``KVStoreFull``, ``KVCorrupt``, …) is raised here; transport
    failures raise ``KVUnavailable``/``KVTruncated``/``KVTimeout``. No retry: ``frames`` cannot be replayed.
    ``deadline_s`` bounds the whole push (``KVTimeout``). ``on_created`` is called once the store has created the
    blob (its ``ack_created`` reply), before the rest is sent and stored. ``context`` is the role's (as for
    ``pull``: limits, client TLS when ``ssl`` is not given, ``max_inflight_kv``, stats; without one, a fresh one)."""
    ctx = context or TransferContext()
    recorder = ctx.stats.push
    async with stats.maybe_slot(ctx.inflight):
        recorder.started()
        start, sent = time.perf_counter(), [0]
        try:
            async with asyncio.timeout(deadline_s):
                put = p.Put(kv_id, max(1, int(idle_s * 1000)), tenant, int(ttl_s * 1000), on_created is not None)
                await _push(address, put, frames, ssl or ctx.client_ssl, timeout_s, sent, on_created, ctx)
        except TimeoutError as exc:
            recorder.finished(False, time.perf_counter() - start, 0, KVTimeout.code)
            raise KVTimeout(f"push {kv_id}: blob deadline of {deadline_s} s passed") from exc
        except PrfaasError as exc:
            recorder.finished(False, time.perf_counter() - start, 0, exc.code)
            raise
        recorder.finished(True, time.perf_counter() - start, sent[0])


async def _push(address: str, put: p.Put, frames: AsyncIterable[Frame] | Iterable[Frame],
                ssl: ssl_module.SSLContext | None, timeout_s: float, sent: list[int],
                on_created: Callable[[], None] | None, ctx: TransferContext) -> None:
    kv_id = put.kv_id
    conn = await connect(address, ssl, timeout_s, unsent_bytes=tcp.UNSENT_BYTES)  # back-pressure: see ``tcp``
    reply = asyncio.create_task(_final_reply(conn, on_created, ctx.limits))
    try:
        with mapped(f"push {kv_id}"):
            try:
                await conn.sendall(p.encode(put))
                await _send_frames(conn, frames, timeout_s, reply, sent)
            except (OSError, PrfaasError):
                await _raise_early_reply(reply)  # the server stopped reading: its error says why
                raise
            async with asyncio.timeout(timeout_s):
                p.expect(await reply, p.Ok)
    finally:
        reply.cancel()
        await asyncio.gather(reply, return_exceptions=True)
        ctx.stats.push.connection(tcp.tcp_info(conn.sock), peer=address)
        await close(conn)


async def _send_frames(conn: Conn, frames: AsyncIterable[Frame] | Iterable[Frame], timeout_s: float,
                       reply: asyncio.Task[p.Message], sent: list[int]) -> None:
    async for frame in _frames(frames):
        if reply.done():
            return  # answered before the trailer: an error, raised by the caller
        async with asyncio.timeout(timeout_s):
            await conn.sendall(frame)
        if frame[:1] == b"C":
            sent[0] += len(frame) - CHUNK_HEAD_SIZE


async def _final_reply(conn: Conn, on_created: Callable[[], None] | None, limits: WireLimits) -> p.Message:
    """The Put's last reply; with ``on_created``, the creation ``Ok`` before it is taken and reported first."""
    message = await p.read_message(conn, limits)
    if on_created is None or not isinstance(message, p.Ok):
        return message
    on_created()
    return await p.read_message(conn, limits)


async def _raise_early_reply(reply: asyncio.Task[p.Message]) -> None:
    done, _ = await asyncio.wait([reply], timeout=EARLY_REPLY_S)
    if done and reply.exception() is None:
        p.expect(reply.result(), p.Ok)


async def _frames(frames: AsyncIterable[Frame] | Iterable[Frame]) -> AsyncIterator[Frame]:
    if isinstance(frames, AsyncIterable):
        async for frame in frames:
            yield frame
    else:
        for frame in frames:
            yield frame


async def release(address: str, kv_id: str, *, ssl: ssl_module.SSLContext | None = None,
                  timeout_s: float = 5.0) -> dict[str, Any]:
    """Acknowledge ``kv_id``: the store deletes it and returns its deletion record (as a dict).
    ``KVNotFound``/``KVExpired`` if it is already gone."""
    record: DeletionRecord = p.expect(await _exchange(address, p.Release(kv_id), ssl, timeout_s), DeletionRecord)
    return record.to_dict()


async def stat(address: str, *, ssl: ssl_module.SSLContext | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The remote store's ``StoreStats`` as a dict (health checks, leak checks)."""
    stats: StoreStats = p.expect(await _exchange(address, p.Stat(), ssl, timeout_s), StoreStats)
    return stats.to_dict()


async def _exchange(address: str, request: p.Message, ssl: ssl_module.SSLContext | None,
                    timeout_s: float) -> p.Message:
    conn = await connect(address, ssl, timeout_s)
    try:
        with mapped(f"{type(request).__name__.lower()} at {address}"):
            async with asyncio.timeout(timeout_s):
                await conn.sendall(p.encode(request))
                return await p.read_message(conn)
    finally:
        await close(conn)
