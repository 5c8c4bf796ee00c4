"""Socket buffers follow the bandwidth-delay product; short links keep the kernel's autotuning."""

from __future__ import annotations

import array
import contextlib
import fcntl
import socket
import termios
import time

from prfaas.transfer import tcp


def test_buffer_is_twice_the_bandwidth_delay_product_capped() -> None:
    assert tcp.buffer_bytes(10e9, 0.05) == 125_000_000
    assert tcp.buffer_bytes(1e12, 1.0) == tcp.MAX_BUFFER


def test_long_fat_links_get_larger_buffers_and_short_ones_autotune() -> None:
    with socket.socket() as short, socket.socket() as long_fat:
        before = long_fat.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        tcp.tune(short, 10e9, 0.0002)  # 2 × BDP = 500 kB: below the autotuning ceiling, left alone
        assert short.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == before
        tcp.tune(long_fat, 10e9, 0.08)  # 2 × BDP = 200 MB: above it
        assert long_fat.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) > before
        assert long_fat.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def _fill(sender: socket.socket, receiver: socket.socket) -> tuple[int, int, tcp.TcpInfo]:
    """Write until the kernel takes no more (the receiver reads nothing); then the bytes written that the receiver has
    not queued, those the sender's kernel says it holds (unacknowledged or unsent) and its ``TCP_INFO``, once the
    last segments are acknowledged."""
    sender.setblocking(False)
    written, data = 0, b"\0" * (1 << 16)
    with contextlib.suppress(BlockingIOError):
        while True:
            written += sender.send(data)
    queued = array.array("i", [0])
    deadline = time.monotonic() + 5
    while True:  # the last segments' acknowledgements may be on their way
        info = tcp.tcp_info(sender)
        assert info is not None
        fcntl.ioctl(receiver, termios.FIONREAD, queued)
        if info.unacked == 0 or time.monotonic() > deadline:
            return written - queued[0], info.unacked * info.snd_mss + info.notsent_bytes, info
        time.sleep(0.01)


def test_tcp_info_says_what_the_sender_still_holds() -> None:
    """Every byte written is either queued at the receiver (acknowledged) or held by the sender's kernel, unsent
    behind the closed window: ``TCP_INFO`` accounts for the rest exactly."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as sender:
        receiver, _ = server.accept()
        with receiver:
            unread, held, info = _fill(sender, receiver)
    assert info.unacked == 0 and info.notsent_bytes > 0
    assert held == unread


def test_a_bounded_sender_holds_at_most_its_unsent_bytes() -> None:
    """``unsent_bytes`` (a push's ``TCP_NOTSENT_LOWAT``): the kernel stops taking bytes once that many wait to be sent,
    give or take the one buffer it was filling."""
    bound = 256 << 10
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket() as sender:
        tcp.tune(sender, unsent_bytes=bound)
        sender.connect(server.getsockname())
        receiver, _ = server.accept()
        with receiver:
            unread, held, info = _fill(sender, receiver)
    assert 0 < info.notsent_bytes <= bound + (1 << 16)
    assert held == unread
