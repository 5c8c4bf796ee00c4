"""One data-plane connection over a raw non-blocking socket: zero-copy ``recv_into``/``sendall`` on the event loop,
plaintext or TLS 1.3.

Why not ``asyncio.StreamReader``: it copies every byte twice (its buffer, then ``readexactly``'s ``bytes``) and
Python 3.11's transports copy whatever a ``write`` could not send at once. Here plaintext bytes go from the kernel
straight into the caller's preallocated buffer and out of the caller's memoryview.

TLS is an ``ssl.SSLSocket`` on the same non-blocking socket (OpenSSL reads and writes the socket itself), waiting
for readiness with ``loop.add_reader``/``add_writer``: OpenSSL encrypts out of the caller's memoryview and
decrypts into the caller's buffer, and no ciphertext passes through Python buffers or memory BIOs (an
``ssl.SSLObject`` over memory BIOs would copy every byte into and out of them). OpenSSL reads each 16 KiB record
with two system calls (its header, then its body); Python's ``ssl`` module offers no read-ahead, and prfaas does
not reach into CPython's private object layout to set it. What bounds TLS goodput is AES-GCM on both ends plus the
kernel's copies (docs/transport.md; figures in docs/benchmarks.md).

A reader that has to wait sets ``SO_RCVLOWAT`` to what its frame still lacks (``_expect``), so a chunk arriving
over a slow path wakes the event loop a few times instead of once per few segments.

Ownership: a ``Conn`` owns its socket and closes it in ``close`` (idempotent); nothing else is left behind.
Failures surface as ``OSError``/``ConnectionError``/``ssl.SSLError``/``TimeoutError``; ``conn.mapped`` turns them
into prfaas errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl as ssl_module
from collections.abc import Callable

TLS_SLICE = 1 << 20  # plaintext handed to OpenSSL per write (it cuts it into 16 KiB records)
TLS_RECORD_BYTES = 16384 + 256 + 5  # the most of one record OpenSSL can hold undecrypted (TLS 1.3: +22 bytes)
LOWAT_MAX = 512 << 10  # a waiting reader wakes once this much (or all it still needs) has arrived
_WANT = (ssl_module.SSLWantReadError, ssl_module.SSLWantWriteError)


class Conn:
    """A connected TCP socket, optionally wrapped in TLS. Use ``open``/``accept`` to make one."""

    def __init__(self, sock: socket.socket, tls: ssl_module.SSLSocket | None = None) -> None:
        sock.setblocking(False)
        self.sock: socket.socket = sock  # after ``start_tls``, the ``SSLSocket`` (the same descriptor)
        self.tls = tls
        self._read: Callable[[memoryview, int], int] | None = None  # TLS: ``recv_into``, one record per call
        self._lowat = 1  # the socket's SO_RCVLOWAT (``_expect``)
        self._loop = asyncio.get_running_loop()
        self._waiters: tuple[list[asyncio.Future[None]], list[asyncio.Future[None]]] = ([], [])  # read, write
        self._send_lock = asyncio.Lock()  # one sendall at a time: TLS records must leave in the order made
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int, ssl: ssl_module.SSLContext | None,
                   setup: Callable[[socket.socket], None] | None = None) -> Conn:
        """Connect (and handshake when ``ssl`` is given); ``setup`` tunes the socket before it connects (buffer
        sizes must be set before the handshake to count). Bound it with ``asyncio.timeout``."""
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        if setup is not None:
            setup(sock)
        conn = cls(sock)
        try:
            await conn._loop.sock_connect(sock, addr)
            if ssl is not None:
                await conn.start_tls(ssl, server_side=False, server_hostname=host)
        except BaseException:
            conn.close()
            raise
        return conn

    async def start_tls(self, ctx: ssl_module.SSLContext, server_side: bool, server_hostname: str | None = None
                        ) -> None:
        """Run the TLS handshake; afterwards every byte is encrypted. A failed handshake has sent its alert
        (expired, revoked, unknown CA …), which tells the peer why, when the error is raised."""
        tls = ctx.wrap_socket(self.sock, server_side=server_side, do_handshake_on_connect=False,
                              server_hostname=None if server_side else server_hostname)
        self.sock = self.tls = tls  # the plain socket object gave its descriptor to the SSLSocket
        self._read = tls.recv_into
        while True:
            try:
                tls.do_handshake()
                return
            except _WANT as exc:
                await self._ready(isinstance(exc, ssl_module.SSLWantWriteError))
            except ssl_module.SSLError:
                self._discard_readable()  # records of the peer's flight we did not read: a close would reset
                raise

    async def recv_into(self, view: memoryview) -> int:
        """Read up to ``len(view)`` bytes into ``view``; 0 at a clean end of stream."""
        if self._read is None:
            return await self._recv_plain(view, 1)
        return await self._recv_tls(view, 1)

    async def _recv_plain(self, view: memoryview, need: int) -> int:
        """One ``recv_into``; when nothing has arrived, wait until ``need`` bytes have (see ``_expect``)."""
        while True:
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                pass
            self._expect(need)
            await self._ready(False)

    async def _recv_tls(self, view: memoryview, need: int) -> int:
        """Decrypt records into ``view`` until it is full or nothing more has arrived; when nothing has, wait
        until the ciphertext of ``need`` bytes can have (OpenSSL may hold part of one record already)."""
        assert self._read is not None
        read, want, got = self._read, len(view), 0
        while got < want:
            try:
                n = read(view[got:] if got else view, want - got)  # one record at most; 0: the stream ended
            except _WANT as exc:
                if got:
                    return got
                if isinstance(exc, ssl_module.SSLWantWriteError):
                    await self._ready(True)
                else:
                    self._expect(need - TLS_RECORD_BYTES)
                    await self._ready(False)
                continue
            except (ssl_module.SSLZeroReturnError, ssl_module.SSLEOFError):
                return got  # close_notify, or the TCP stream ended (a caller that wanted more says so)
            if n == 0:
                return got
            got += n
        return got

    async def recv_exactly(self, view: memoryview) -> None:
        """Fill ``view`` completely; ``asyncio.IncompleteReadError`` if the peer closes first."""
        got, want = 0, len(view)
        while got < want:
            if self._read is None:
                n = await self._recv_plain(view[got:] if got else view, want - got)
            else:
                n = await self._recv_tls(view[got:] if got else view, want - got)
            if n == 0:
                raise asyncio.IncompleteReadError(bytes(view[:got]), len(view))
            got += n

    async def read_exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.recv_exactly(memoryview(buf))
        return buf

    async def sendall(self, *views: bytes | bytearray | memoryview) -> None:
        """Send every byte of ``views`` in order (no concatenation: each is sent from its own memory)."""
        async with self._send_lock:
            for data in views:
                if self.tls is None:
                    await self._loop.sock_sendall(self.sock, data)
                    continue
                view = memoryview(data)
                for off in range(0, len(view), TLS_SLICE):
                    await self._tls_write(view[off:off + TLS_SLICE])

    async def _tls_write(self, piece: memoryview) -> None:
        assert self.tls is not None
        while piece:
            try:
                sent = self.tls.send(piece)
            except _WANT as exc:  # retried with the same piece: OpenSSL resumes the records it had begun
                self._expect(1)
                await self._ready(isinstance(exc, ssl_module.SSLWantWriteError))
                continue
            piece = piece[sent:]

    def _expect(self, need: int) -> None:
        """Before a reader waits: wake it only once ``need`` bytes (at most ``LOWAT_MAX``) are queued
        (``SO_RCVLOWAT``), so a large frame arrives in a few wake-ups of the event loop instead of one per few
        segments (on a 1 Gbit path a wake-up brought a few KiB). Never more than the waiter still needs (set before
        every wait, one system call when it changes): the kernel also wakes it at end of stream, on errors, and
        when its buffer or window runs short.

        The threshold stays within a quarter of the socket's current receive buffer: Linux meets a larger one by
        growing the buffer to it and clamping the advertised window to the threshold, and autotuning, which grows
        the window from what arrives per round trip, then never lifts the clamp: a fresh connection stays at
        512 KiB per round trip (45 Mbit/s over 50 ms of RTT, docs/planning.md). A quarter keeps the kernel's
        space for it below the buffer (the space is twice the window at its default scaling ratio)."""
        target = max(1, min(need, LOWAT_MAX, self._receive_buffer() // 4))
        if target != self._lowat:
            self._lowat = target
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, target)

    def _receive_buffer(self) -> int:
        """The socket's receive buffer now (``SO_RCVBUF``: autotuning grows it as the connection speeds up)."""
        try:
            return int(self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
        except OSError:
            return LOWAT_MAX

    def write_eof(self) -> None:
        """Half-close: the peer reads end-of-stream after what was sent (TLS state kept: no close_notify)."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_WR)  # ``SSLSocket.shutdown`` would drop the TLS state

    async def drain(self, scratch: memoryview) -> int:
        """Read and drop raw bytes (TLS records too, undecrypted); 0 at end of stream."""
        while True:
            try:
                return socket.socket.recv_into(self.sock, scratch)
            except (BlockingIOError, InterruptedError):
                self._expect(1)
                await self._ready(False)

    def _discard_readable(self, limit: int = 1 << 20) -> None:
        """Read and drop what has already arrived (without waiting), so that closing sends a FIN, not a reset."""
        scratch, dropped = bytearray(1 << 16), 0
        with contextlib.suppress(OSError):
            while dropped < limit and (n := socket.socket.recv_into(self.sock, scratch)):
                dropped += n

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for write, waiters in enumerate(self._waiters):
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(ConnectionAbortedError("data-plane connection closed"))
                waiters.clear()
                self._unwatch(write)
            self.sock.close()

    async def _ready(self, write: bool) -> None:
        """Wait until the socket is readable (``write`` False) or writable. Concurrent waiters share one
        registration, so a reader and a writer (or two readers) never replace each other's callback."""
        waiters = self._waiters[write]
        fut = self._loop.create_future()
        if not waiters:
            if write:
                self._loop.add_writer(self.sock.fileno(), self._wake, 1)
            else:
                self._loop.add_reader(self.sock.fileno(), self._wake, 0)
        waiters.append(fut)
        try:
            await fut
        finally:
            if fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    self._unwatch(write)

    def _wake(self, write: int) -> None:
        waiters = self._waiters[write]
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        waiters.clear()
        self._unwatch(write)

    def _unwatch(self, write: int) -> None:
        fd = self.sock.fileno()
        if fd < 0:
            return
        if write:
            self._loop.remove_writer(fd)
        else:
            self._loop.remove_reader(fd)
