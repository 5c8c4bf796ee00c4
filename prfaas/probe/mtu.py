"""Path MTU: the kernel's route MTU (``IP_MTU`` on a connected UDP socket with don't-fragment set),
confirmed by echoing don't-fragment datagrams off the probe server, searching down when the biggest is
lost."""

from __future__ import annotations

import contextlib
import socket
import sys

# Linux values (<linux/in.h>); Python does not export all of them.
IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
IP_MTU = getattr(socket, "IP_MTU", 14)
IP_UDP_HEADERS = 28
MAX_IP_PACKET = 65535
MIN_MTU = 576


def _echoes(sock: socket.socket, size: int, timeout: float) -> bool:
    payload = b"m" * size
    sock.settimeout(timeout)
    try:
        sock.send(payload)
        for _ in range(4):
            if sock.recv(MAX_IP_PACKET) == payload:
                return True
    except OSError:
        return False
    return False


def path_mtu(host: str, port: int, timeout: float = 0.3) -> tuple[int, str]:
    """(MTU in bytes, how it was found)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        route = 1500
        source = "assumed 1500"
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        sock.connect((host, port))
        with contextlib.suppress(OSError):
            route = sock.getsockopt(socket.IPPROTO_IP, IP_MTU)
            source = "IP_MTU"
        top = min(route, MAX_IP_PACKET)
        if _echoes(sock, top - IP_UDP_HEADERS, timeout):
            return route, f"{source}, confirmed by a {top}-byte don't-fragment echo"
        lo, hi = MIN_MTU, top
        for _ in range(12):
            if hi - lo <= 8:
                break
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _echoes(sock, mid - IP_UDP_HEADERS, timeout) else (lo, mid)
        return lo, f"{source} said {route}; largest echoed don't-fragment packet {lo}"
