"""Socket buffers follow the bandwidth-delay product; short links keep the kernel's autotuning."""

from __future__ import annotations

import socket

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
