"""One data-plane connection over a raw non-blocking socket: zero-copy ``recv_into``/``sendall`` on the event loop,
plaintext or TLS 1.3 (an ``ssl.SSLObject`` over memory BIOs, so both paths share one interface).

Why not ``asyncio.StreamReader``: it copies every byte twice (its buffer, then ``readexactly``'s ``bytes``) and
Python 3.11's transports copy whatever a ``write`` could not send at once. Here plaintext bytes go from the kernel
straight into the caller's preallocated buffer and out of the caller's memoryview; TLS decrypts straight into the
caller's buffer.

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
from typing import cast

TLS_SLICE = 256 << 10  # plaintext handed to OpenSSL per write: a few 16 KiB records, one sendall
TLS_READ = 1 << 20  # ciphertext read per recv


class Conn:
    """A connected TCP socket, optionally wrapped in TLS. Use ``open``/``accept`` to make one."""

    def __init__(self, sock: socket.socket, tls: ssl_module.SSLObject | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.tls = tls
        self._in = ssl_module.MemoryBIO()
        self._out = ssl_module.MemoryBIO()
        self._scratch = bytearray(TLS_READ) if tls is not None else bytearray()
        self._loop = asyncio.get_running_loop()
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
        """Run the TLS handshake; afterwards every byte is encrypted."""
        self._scratch = bytearray(TLS_READ)
        self.tls = ctx.wrap_bio(self._in, self._out, server_side=server_side,
                                server_hostname=None if server_side else server_hostname)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl_module.SSLWantReadError:
                await self._flush()
                await self._fill()
            except ssl_module.SSLError:
                with contextlib.suppress(OSError):
                    await self._flush()  # our alert (expired, revoked, unknown CA …) tells the peer why
                raise
        await self._flush()

    async def recv_into(self, view: memoryview) -> int:
        """Read up to ``len(view)`` bytes into ``view``; 0 at a clean end of stream."""
        if self.tls is None:
            return await self._loop.sock_recv_into(self.sock, view)
        got = 0
        while got < len(view):
            try:
                n = cast(int, self.tls.read(len(view) - got, view[got:]))  # typeshed: bytes; a count with a buffer
            except ssl_module.SSLWantReadError:
                if got:
                    return got
                await self._flush()  # post-handshake messages (key updates) may want an answer
                if not await self._fill():
                    return 0
                continue
            except ssl_module.SSLZeroReturnError:
                return got
            if n == 0:
                return got
            got += n
        return got

    async def recv_exactly(self, view: memoryview) -> None:
        """Fill ``view`` completely; ``asyncio.IncompleteReadError`` if the peer closes first."""
        got = 0
        while got < len(view):
            n = await self.recv_into(view[got:])
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
                    self.tls.write(view[off:off + TLS_SLICE])
                    await self._send_out()

    def write_eof(self) -> None:
        """Half-close: the peer reads end-of-stream after what was sent."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    async def _flush(self) -> None:
        if self._out.pending:
            async with self._send_lock:
                await self._send_out()

    async def _send_out(self) -> None:
        if self._out.pending:
            await self._loop.sock_sendall(self.sock, self._out.read())

    async def _fill(self) -> bool:
        n = await self._loop.sock_recv_into(self.sock, self._scratch)
        if n == 0:
            self._in.write_eof()
            return False
        self._in.write(memoryview(self._scratch)[:n])
        return True
