"""``Conn`` itself, plaintext and TLS: a large read waits for many bytes at once (``SO_RCVLOWAT``), yet never for
more than it still needs: a small frame right after a large one, a large frame whose sender pauses half-way, a
peer that ends the stream early, and a peer that stalls all end as they should."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from prfaas.transfer.wire import Conn
from tests.transfer.helpers import run
from tests.transfer.test_tls import contexts

BIG = 3 << 20
SOME = 192 << 10  # less than a waiting reader's threshold, more than a TLS record
PAYLOAD = bytes(range(256)) * (BIG // 256)

Scenario = Callable[[Conn, Conn], Awaitable[None]]


def pair(tmp_path: Path, tls: bool, scenario: Scenario) -> None:
    """Run ``scenario(sender, receiver)`` on a connected pair of ``Conn``s (TLS 1.3 when ``tls``)."""
    if tls and shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    server_ctx, client_ctx, _ = contexts(tmp_path) if tls else (None, None, None)

    async def main() -> None:
        accepted: asyncio.Future[Conn] = asyncio.get_running_loop().create_future()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket").dup()
            writer.transport.abort()
            conn = Conn(sock)
            if server_ctx is not None:
                await conn.start_tls(server_ctx, server_side=True)
            accepted.set_result(conn)

        listener = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        receiver = await Conn.open("127.0.0.1", port, client_ctx)
        sender = await accepted
        listener.close()
        await listener.wait_closed()
        try:
            await scenario(sender, receiver)
        finally:
            sender.close()
            receiver.close()

    run(main)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_small_frame_after_a_large_one_and_a_pause_half_way(tmp_path: Path, tls: bool) -> None:
    async def scenario(sender: Conn, receiver: Conn) -> None:
        async def send() -> None:
            last = SOME  # the reader must not wait for more than the frame lacks
            await sender.sendall(PAYLOAD[:BIG - last])
            await asyncio.sleep(0.2)  # the reader waits, for no more than the frame still lacks
            await sender.sendall(PAYLOAD[BIG - last:])
            await asyncio.sleep(0.2)  # then for 4 bytes, not for a threshold
            await sender.sendall(b"tail")

        task = asyncio.create_task(send())
        big = bytearray(BIG)
        async with asyncio.timeout(5):
            await receiver.recv_exactly(memoryview(big))
            assert await receiver.read_exactly(4) == b"tail"
        assert big == PAYLOAD
        await task

    pair(tmp_path, tls, scenario)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_stream_that_ends_short_of_a_large_frame_ends_the_read(tmp_path: Path, tls: bool) -> None:
    async def scenario(sender: Conn, receiver: Conn) -> None:
        await sender.sendall(PAYLOAD[:SOME])
        sender.write_eof()
        async with asyncio.timeout(5):
            with pytest.raises(asyncio.IncompleteReadError) as caught:
                await receiver.recv_exactly(memoryview(bytearray(BIG)))
        assert len(caught.value.partial) == SOME

    pair(tmp_path, tls, scenario)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_stalled_large_frame_times_out_and_a_reset_is_a_connection_error(tmp_path: Path, tls: bool) -> None:
    async def scenario(sender: Conn, receiver: Conn) -> None:
        await sender.sendall(PAYLOAD[:SOME])
        view = memoryview(bytearray(BIG))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await receiver.recv_exactly(view)
        sender.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sender.close()  # an RST
        async with asyncio.timeout(5):
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError, ssl.SSLError)):
                await receiver.recv_exactly(view)

    pair(tmp_path, tls, scenario)


def test_a_put_that_asks_for_no_ack_is_encoded_as_before() -> None:
    """Older servers refuse unknown fields in a control message: a Put sends ``ack_created`` only when it asks for
    the early acknowledgement, so every other Put still reaches an older relay."""
    import msgpack

    from prfaas.transfer import protocol as p

    plain, acked = p.Put("k", 10), p.Put("k", 10, ack_created=True)
    assert "ack_created" not in msgpack.unpackb(p.encode(plain)[9:])[2]
    assert p.decode(p.encode(plain)[9:]) == plain and p.decode(p.encode(acked)[9:]) == acked


def test_a_waiting_reader_never_asks_for_more_than_a_quarter_of_its_receive_buffer(tmp_path: Path) -> None:
    """Linux meets an ``SO_RCVLOWAT`` larger than the receive buffer by clamping the advertised window to it for
    good: a fresh connection then moves 512 KiB per round trip. The threshold stays within a quarter of the
    buffer the socket has when it waits."""
    async def scenario(sender: Conn, receiver: Conn) -> None:
        before = receiver.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        read = asyncio.create_task(receiver.recv_exactly(memoryview(bytearray(BIG))))
        await asyncio.sleep(0.1)  # the reader is waiting for the whole frame
        asked = receiver.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        await sender.sendall(PAYLOAD)
        async with asyncio.timeout(5):
            await read
        assert 1 < asked <= before // 4, (asked, before)

    pair(tmp_path, False, scenario)
