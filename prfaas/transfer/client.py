"""Data-plane client: ``push`` a blob into a remote store, ``pull`` one out (resuming after failures), ``release``
it, ``stat`` the store. Every call opens its own connection and closes it before returning, whatever happens.

Timeouts: ``timeout_s`` bounds each wait on the network — connecting, one reply, one frame (one chunk is one
"transfer" in the contract's sense). The caller bounds the whole blob: its deadline is chunk count × (chunk bytes
/ measured bandwidth) + ``kv_transfer_timeout_ms`` (CONTRACTS.md), e.g. with ``asyncio.timeout`` around ``pull``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl as ssl_module
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any

from prfaas.errors import KVBadFormat, KVCorrupt, KVIncompatible, KVTimeout, KVTruncated, KVUnavailable, PrfaasError
from prfaas.kv.format import BlobReader, parse_trailer
from prfaas.kv.state import KVState, LayerState
from prfaas.store.records import DeletionRecord, StoreStats
from prfaas.transfer import protocol as p
from prfaas.transfer.conn import close, connect, mapped

log = logging.getLogger(__name__)
RESUMABLE = (KVTimeout, KVCorrupt, KVTruncated, KVUnavailable)
BACKOFF_S, BACKOFF_CAP_S = 0.05, 2.0
EARLY_REPLY_S = 0.5

LayersCallback = Callable[[list[LayerState]], None]


def backoff(attempt: int, base_s: float = BACKOFF_S) -> float:
    """Exponential backoff with jitter before retry number ``attempt`` (1, 2, …): half to all of
    ``base_s × 2^(attempt-1)``, capped at ``BACKOFF_CAP_S``."""
    return min(BACKOFF_CAP_S, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


async def pull(address: str, kv_id: str, reader: BlobReader, *, timeout_s: float, retries: int = 2,
               ssl: ssl_module.SSLContext | None = None, on_layers: LayersCallback | None = None,
               backoff_s: float = BACKOFF_S, on_retry: Callable[[int, PrfaasError], None] | None = None) -> KVState:
    """Read blob ``kv_id`` from the store at ``address`` into ``reader`` (the caller owns it) and return the
    verified state. A reset, a stall past ``timeout_s``, a corrupt chunk (never used: fetched again) or a
    truncated stream resumes from ``reader.next_chunk`` on a new connection, after exponential backoff with
    jitter, at most ``retries`` times; then the last error is raised. ``KVNotFound``, ``KVExpired``,
    ``KVBadFormat``, ``KVIncompatible`` and ``KVTooLarge`` are raised at once. ``on_layers`` gets layers as they
    complete (decode restores while chunks still arrive); ``on_retry`` is told each retry (for metrics)."""
    attempt = 0
    while True:
        try:
            await _pull_once(address, kv_id, reader, timeout_s, ssl, on_layers)
            return reader.state()
        except RESUMABLE as exc:
            if attempt >= retries:
                raise
            attempt += 1
            log.info("pull %s: %s; retry %d/%d from chunk %d", kv_id, exc.code, attempt, retries,
                     reader.next_chunk)
            if on_retry is not None:
                on_retry(attempt, exc)
            await asyncio.sleep(backoff(attempt, backoff_s))


async def _pull_once(address: str, kv_id: str, reader: BlobReader, timeout_s: float,
                     ssl: ssl_module.SSLContext | None, on_layers: LayersCallback | None) -> None:
    stream, writer = await connect(address, ssl, timeout_s)
    try:
        with mapped(f"pull {kv_id}"):
            writer.write(p.encode(p.Get(kv_id, reader.next_chunk, max(1, int(timeout_s * 1000)))))
            async with asyncio.timeout(timeout_s):
                await writer.drain()
                p.expect(await p.read_message(stream), p.Ok)
            await _read_blob(stream, kv_id, reader, timeout_s, on_layers)
    finally:
        await close(writer)


async def _read_blob(stream: asyncio.StreamReader, kv_id: str, reader: BlobReader, timeout_s: float,
                     on_layers: LayersCallback | None) -> None:
    first = await _next_frame(stream, timeout_s, 0)  # the header; a chunk here may not carry a payload
    if first.tag != b"P":
        raise KVBadFormat(f"blob {kv_id} did not start with its header frame")
    reader.resume_header(first.whole)
    assert reader.header is not None
    if reader.header.kv_id != kv_id:
        raise KVIncompatible(f"asked for blob {kv_id}, got {reader.header.kv_id}")
    while not reader.done:
        layers = _feed(reader, await _next_frame(stream, timeout_s, reader.header.chunk_size))
        if layers and on_layers is not None:
            on_layers(layers)


async def _next_frame(stream: asyncio.StreamReader, timeout_s: float, max_chunk: int) -> p.Frame:
    async with asyncio.timeout(timeout_s):
        return await p.read_frame(stream, max_chunk)


def _feed(reader: BlobReader, frame: p.Frame) -> list[LayerState]:
    """Verify and use one frame; a frame that fails a check leaves ``reader`` as it was."""
    if frame.tag == b"C":
        return reader.feed_chunk(frame.index, frame.data, frame.checksum)
    if frame.tag == b"T":
        parse_trailer(frame.whole)
        return reader.feed(frame.whole)
    if isinstance(frame.message, p.Error):
        raise frame.message.exception()  # the server gave up on the blob mid-stream (expired, aborted, stalled)
    raise KVBadFormat(f"unexpected {frame.tag!r} frame inside a blob")


async def push(address: str, kv_id: str, frames: AsyncIterable[bytes] | Iterable[bytes], *,
               ssl: ssl_module.SSLContext | None = None, timeout_s: float, idle_s: float = 30.0) -> None:
    """Stream blob ``kv_id`` (its frames: header, chunks, trailer) into the store at ``address`` as ``frames``
    yields them; returns once the store holds the whole blob. ``timeout_s`` bounds each network wait; ``idle_s``
    is how long the server waits for the next frame (the producer's pace). On failure the server aborts the
    blob (no partial blob is left) and its error (``KVStoreFull``, ``KVCorrupt``, …) is raised here; transport
    failures raise ``KVUnavailable``/``KVTruncated``/``KVTimeout``. No retry: ``frames`` cannot be replayed."""
    stream, writer = await connect(address, ssl, timeout_s)
    reply = asyncio.create_task(p.read_message(stream))
    try:
        with mapped(f"push {kv_id}"):
            try:
                writer.write(p.encode(p.Put(kv_id, max(1, int(idle_s * 1000)))))
                await _send_frames(writer, frames, timeout_s, reply)
            except (OSError, PrfaasError):
                await _raise_early_reply(reply)  # the server stopped reading: its error says why
                raise
            async with asyncio.timeout(timeout_s):
                p.expect(await reply, p.Ok)
    finally:
        reply.cancel()
        await asyncio.gather(reply, return_exceptions=True)
        await close(writer)


async def _send_frames(writer: asyncio.StreamWriter, frames: AsyncIterable[bytes] | Iterable[bytes],
                       timeout_s: float, reply: asyncio.Task[p.Message]) -> None:
    async for frame in _frames(frames):
        if reply.done():
            return  # answered before the trailer: an error, raised by the caller
        writer.write(frame)
        async with asyncio.timeout(timeout_s):
            await writer.drain()


async def _raise_early_reply(reply: asyncio.Task[p.Message]) -> None:
    done, _ = await asyncio.wait([reply], timeout=EARLY_REPLY_S)
    if done and reply.exception() is None:
        p.expect(reply.result(), p.Ok)


async def _frames(frames: AsyncIterable[bytes] | Iterable[bytes]) -> AsyncIterator[bytes]:
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
    stream, writer = await connect(address, ssl, timeout_s)
    try:
        with mapped(f"{type(request).__name__.lower()} at {address}"):
            async with asyncio.timeout(timeout_s):
                writer.write(p.encode(request))
                await writer.drain()
                return await p.read_message(stream)
    finally:
        await close(writer)
