"""``TransferServer``: serves one ``BlobStore`` on the data plane (relay mode: the relay's store; direct mode: the
store inside a prefill process).

Lifecycle: ``start`` binds and accepts (beyond ``max_connections`` at once, a new connection is answered
``KV_UNAVAILABLE``); each connection is a task that handles exchanges in turn until the peer
closes, an error is answered, or it idles past ``idle_s``; ``close`` stops accepting, cancels every connection
task and closes its socket. The server never owns blobs: a Put that fails half-way aborts its blob in the store
(record ``aborted``), so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module

from prfaas.errors import InvalidRequest, KVBadFormat, KVTimeout, KVUnavailable, PrfaasError
from prfaas.kv.format import parse_header
from prfaas.store.memory import BlobStore
from prfaas.transfer import protocol as p
from prfaas.transfer.conn import STREAM_LIMIT, close, mapped, tune

log = logging.getLogger(__name__)
MAX_WAIT_S = 60.0  # a client's wait_ms is capped at this
LINGER_S = 0.5  # after an error reply, read and drop what the peer still sends, so our close does not reset it


class TransferServer:
    """Data-plane server for ``store`` on ``host:port`` (port 0: any free port), TLS when ``ssl`` is given."""

    def __init__(self, store: BlobStore, host: str = "127.0.0.1", port: int = 0,
                 ssl: ssl_module.SSLContext | None = None, idle_s: float = 30.0, send_timeout_s: float = 30.0,
                 max_connections: int = 256) -> None:
        self.store, self.host, self.port, self.ssl = store, host, port, ssl
        self.idle_s, self.send_timeout_s, self.max_connections = idle_s, send_timeout_s, max_connections
        self.connections = 0  # accepted since start (tests count retries with it)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Bind and start accepting; returns the bound port."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port, ssl=self.ssl,
                                                  limit=STREAM_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop accepting, cancel the connection tasks and close their sockets. Blobs stay in the store."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        tune(writer)
        try:
            try:
                if len(self._tasks) > self.max_connections:
                    raise KVUnavailable(f"data-plane server busy ({self.max_connections} connections)")
                await self._serve(reader, writer)
            except PrfaasError as exc:
                await self._answer_error(reader, writer, exc)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the peer went away or idled out: nothing to answer
        except asyncio.CancelledError:
            pass  # close(): this top-level task just ends (asyncio's stream callback would log a re-raise)
        finally:
            self._tasks.discard(task)
            await close(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                async with asyncio.timeout(self.idle_s):
                    request = await p.read_message(reader)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                return  # clean close between exchanges
            await self._dispatch(request, reader, writer)

    async def _dispatch(self, request: p.Message, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if isinstance(request, p.Get):
            await self._get(request, writer)
        elif isinstance(request, p.Put):
            await self._put(request, reader)
            await self._send(writer, [p.encode(p.Ok())])
        elif isinstance(request, p.Release):
            await self._send(writer, [p.encode(self.store.release(request.kv_id))])
        elif isinstance(request, p.Stat):
            await self._send(writer, [p.encode(self.store.stats())])
        else:
            raise InvalidRequest(f"{type(request).__name__} is not a request")

    async def _get(self, request: p.Get, writer: asyncio.StreamWriter) -> None:
        frames = self.store.frames(request.kv_id, request.from_chunk, _wait_s(request.wait_ms))
        async with contextlib.aclosing(frames):
            header = await anext(frames)  # lookup errors are answered before Ok
            await self._send(writer, [p.encode(p.Ok()), header])
            async for frame in frames:
                await self._send(writer, [frame])

    async def _put(self, request: p.Put, reader: asyncio.StreamReader) -> None:
        wait_s = _wait_s(request.wait_ms)
        async with asyncio.timeout(wait_s):
            first = await p.read_frame(reader, max_chunk=0)
        if first.tag != b"P":
            raise KVBadFormat("a Put must start with the blob's header frame")
        header, frame = parse_header(first.whole)
        self.store.create(request.kv_id, frame)
        try:
            while not await self._put_frame(request.kv_id, reader, header.chunk_size, wait_s):
                pass
        except BaseException:
            with contextlib.suppress(PrfaasError):
                self.store.abort(request.kv_id)
            raise

    async def _put_frame(self, kv_id: str, reader: asyncio.StreamReader, chunk_size: int, wait_s: float) -> bool:
        """Store the next frame of a Put; True once the trailer is in."""
        try:
            async with asyncio.timeout(wait_s):
                frame = await p.read_frame(reader, chunk_size)
        except TimeoutError as exc:
            raise KVTimeout(f"pusher of {kv_id} sent nothing for {wait_s:.3f} s") from exc
        if frame.tag == b"C":
            self.store.append(kv_id, frame.whole)
            return False
        if frame.tag == b"T":
            self.store.finish(kv_id, frame.whole)
            return True
        raise KVBadFormat(f"unexpected {frame.tag!r} frame inside a Put")

    async def _send(self, writer: asyncio.StreamWriter, frames: list[bytes]) -> None:
        writer.writelines(frames)
        async with asyncio.timeout(self.send_timeout_s):
            await writer.drain()

    async def _answer_error(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            exc: PrfaasError) -> None:
        with contextlib.suppress(PrfaasError), mapped("error reply"):
            await self._send(writer, [p.encode(p.Error.of(exc))])
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await reader.read(1 << 16):
                    pass


def _wait_s(wait_ms: int) -> float:
    return min(max(wait_ms, 1) / 1000, MAX_WAIT_S)
