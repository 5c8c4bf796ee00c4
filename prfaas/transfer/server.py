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
import socket
import ssl as ssl_module
from collections.abc import Callable

from prfaas.errors import InvalidRequest, KVBadFormat, KVTimeout, KVUnauthorized, KVUnavailable, PrfaasError
from prfaas.kv.format import parse_header
from prfaas.kv.frames import FramePool
from prfaas.limits import WireLimits
from prfaas.store.access import accessing
from prfaas.store.memory import BlobStore
from prfaas.tls import TLS_HANDSHAKE, first_byte
from prfaas.transfer import protocol as p
from prfaas.transfer import tcp
from prfaas.transfer.conn import mapped
from prfaas.transfer.wire import Conn

log = logging.getLogger(__name__)
MAX_WAIT_S = 60.0  # a client's wait_ms is capped at this
RECEIVE_POOL_BYTES = 256 << 20  # at most this much pushed-chunk memory (or the store's budget) is kept for reuse
LINGER_S = 0.5  # after an error reply, read and drop what the peer still sends, so our close does not reset it


class TransferServer:
    """Data-plane server for ``store`` on ``host:port`` (port 0: any free port), TLS when ``ssl`` is given.
    Every frame a peer sends is checked against the store's wire limits (``store.limits``), the ones its frames
    are checked against again when stored."""

    def __init__(self, store: BlobStore, host: str = "127.0.0.1", port: int = 0,
                 ssl: ssl_module.SSLContext | None = None, idle_s: float = 30.0, send_timeout_s: float = 30.0,
                 max_connections: int = 256, authorize: Callable[[p.Message, Conn], None] | None = None,
                 on_tls_refused: Callable[[Conn, BaseException | None], None] | None = None) -> None:
        self.store, self.host, self.port, self.ssl = store, host, port, ssl
        self.limits: WireLimits = store.limits
        self.authorize = authorize  # raises (KVUnauthorized) to refuse a request before it touches the store
        self.on_tls_refused = on_tls_refused  # a failed handshake (None: a plaintext peer), e.g. to the audit log
        self.idle_s, self.send_timeout_s, self.max_connections = idle_s, send_timeout_s, max_connections
        self.connections = 0  # accepted since start (tests count retries with it)
        # pushed chunks, received into buffers that blobs released before them left (prfaas.kv.frames)
        self.frames = FramePool(min(store.budget_bytes, RECEIVE_POOL_BYTES))
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Bind and start accepting; returns the bound port."""
        self._sock = socket.create_server((self.host, self.port), backlog=512)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept())
        return self.port

    async def close(self) -> None:
        """Stop accepting, cancel the connection tasks and close their sockets. Blobs stay in the store."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
            self._accepting = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # e.g. out of file descriptors: keep serving the connections we have
                log.warning("data-plane accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            tcp.tune(sock)
            task = asyncio.create_task(self._handle(Conn(sock)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, conn: Conn) -> None:
        self.connections += 1
        try:
            try:
                if self.ssl is not None:
                    await self._secure(conn)
                if len(self._tasks) > self.max_connections:
                    raise KVUnavailable(f"data-plane server busy ({self.max_connections} connections)")
                with mapped("data-plane request"):
                    await self._serve(conn)
            except PrfaasError as exc:
                await self._answer_error(conn, exc)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ssl_module.SSLError):
            pass  # the peer went away, idled out or failed its handshake: nothing to answer
        except asyncio.CancelledError:
            pass  # close(): this top-level task just ends
        finally:
            conn.close()

    async def _secure(self, conn: Conn) -> None:
        """The TLS handshake. A plaintext peer is answered ``KV_UNAUTHORIZED`` in plaintext before anything it
        sent is read; a refused certificate gets its TLS alert, then the connection lingers so the alert arrives."""
        async with asyncio.timeout(self.idle_s):
            first = await first_byte(conn.sock)
        if first and first != TLS_HANDSHAKE:
            if self.on_tls_refused is not None:
                self.on_tls_refused(conn, None)
            raise KVUnauthorized("this data-plane server accepts TLS 1.3 only")
        assert self.ssl is not None
        try:
            async with asyncio.timeout(self.idle_s):
                await conn.start_tls(self.ssl, server_side=True)
        except ssl_module.SSLError as exc:
            if self.on_tls_refused is not None:
                self.on_tls_refused(conn, exc)
            await self._linger(conn)
            raise

    async def _serve(self, conn: Conn) -> None:
        while True:
            try:
                async with asyncio.timeout(self.idle_s):
                    request = await p.read_message(conn, self.limits)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                return  # clean close between exchanges
            await self._dispatch(request, conn)

    async def _dispatch(self, request: p.Message, conn: Conn) -> None:
        if self.authorize is not None:
            self.authorize(request, conn)
        if isinstance(request, p.Get):
            await self._get(request, conn)
        elif isinstance(request, p.Put):
            await self._put(request, conn)
            await self._send(conn, p.encode(p.Ok()))
        elif isinstance(request, p.Release):
            await self._send(conn, p.encode(self.store.release(request.kv_id)))
        elif isinstance(request, p.Stat):
            await self._send(conn, p.encode(self.store.stats()))
        else:
            raise InvalidRequest(f"{type(request).__name__} is not a request")

    async def _get(self, request: p.Get, conn: Conn) -> None:
        """Header, then this Get's chunks (every ``stride``-th from ``offset``), then the trailer; each frame is
        sent from the store's own memory."""
        frames = self.store.frames(request.kv_id, request.from_chunk, _wait_s(request.wait_ms))
        async with contextlib.aclosing(frames):
            header = await anext(frames)  # lookup errors are answered before Ok
            await self._send(conn, p.encode(p.Ok()), header)
            index = request.from_chunk
            async for frame in frames:
                if frame[:1] != b"C" or request.wants(index):
                    await self._send(conn, frame)
                index += 1

    async def _put(self, request: p.Put, conn: Conn) -> None:
        wait_s = _wait_s(request.wait_ms)
        async with asyncio.timeout(wait_s):
            first = await p.read_frame(conn, max_chunk=0, limits=self.limits)
        if first.tag != b"P":
            raise KVBadFormat("a Put must start with the blob's header frame")
        header, frame = parse_header(first.whole, self.limits)
        with accessing(tenant=request.tenant):
            self.store.create(request.kv_id, frame, ttl_s=request.ttl_ms / 1000)
        try:
            if request.ack_created:  # the pusher's readers may Get it from now on
                await self._send(conn, p.encode(p.Ok()))
            while not await self._put_frame(request.kv_id, conn, header.chunk_size, wait_s):
                pass
        except BaseException:
            with contextlib.suppress(PrfaasError):
                self.store.abort(request.kv_id)
            raise

    async def _put_frame(self, kv_id: str, conn: Conn, chunk_size: int, wait_s: float) -> bool:
        """Store the next frame of a Put (received into its own buffer, kept as is); True once the trailer is in."""
        try:
            async with asyncio.timeout(wait_s):
                frame = await p.read_frame(conn, chunk_size, limits=self.limits, pool=self.frames)
        except TimeoutError as exc:
            raise KVTimeout(f"pusher of {kv_id} sent nothing for {wait_s:.3f} s") from exc
        if frame.tag == b"C":
            self.store.append(kv_id, frame.whole)  # type: ignore[arg-type]  # bytes-like, kept as received
            return False
        if frame.tag == b"T":
            self.store.finish(kv_id, bytes(frame.whole))
            return True
        raise KVBadFormat(f"unexpected {frame.tag!r} frame inside a Put")

    async def _send(self, conn: Conn, *frames: bytes) -> None:
        async with asyncio.timeout(self.send_timeout_s):
            await conn.sendall(*frames)

    async def _answer_error(self, conn: Conn, exc: PrfaasError) -> None:
        with contextlib.suppress(PrfaasError), mapped("error reply"):
            await self._send(conn, p.encode(p.Error.of(exc)))
            await self._linger(conn)

    async def _linger(self, conn: Conn) -> None:
        """Half-close, then read and drop what the peer still sends, so our close does not reset what we sent."""
        with contextlib.suppress(OSError, TimeoutError):
            conn.write_eof()
            scratch = memoryview(bytearray(1 << 16))
            async with asyncio.timeout(LINGER_S):
                while await conn.drain(scratch):
                    pass


def _wait_s(wait_ms: int) -> float:
    return min(max(wait_ms, 1) / 1000, MAX_WAIT_S)
