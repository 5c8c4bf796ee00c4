"""TCP socket options for the data plane: buffer sizes from the bandwidth-delay product, a bound on what a sender's
kernel holds unsent, and ``TCP_INFO``.

Buffer rule: a connection needs about 2 × BDP (bandwidth × RTT) of buffer to keep the pipe full. Linux
autotunes receive and send buffers up to ``net.ipv4.tcp_rmem``/``tcp_wmem``'s maximum, and setting ``SO_RCVBUF``
turns autotuning off, so the buffers are set only when 2 × BDP is above that ceiling (long fat links); then to
2 × BDP (``SO_*BUFFORCE`` when root, else ``SO_*BUF``, which the kernel caps at ``net.core.*mem_max``).

Unsent bytes: Linux autotunes the send buffer to several times the congestion window, so on a long fat link a bulk
sender's kernel holds tens of MB written and not yet sent (up to ``tcp_wmem``'s maximum). A push bounds that with
``TCP_NOTSENT_LOWAT`` (``UNSENT_BYTES``): the socket takes more only while less than that waits to be sent, so a push
holds its own queue plus a few MiB, and its back-pressure reaches the engine when the queue says
(``prfaas.plan.transfer`` models it; docs/transport.md has what it changed).
"""

from __future__ import annotations

import contextlib
import socket
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_RTT_S = 0.001
MAX_BUFFER = 256 << 20
UNSENT_BYTES = 4 << 20  # what a push's kernel may hold written and not yet sent (TCP_NOTSENT_LOWAT)
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
# struct tcp_info (linux/tcp.h): 8 one-byte fields, then u32s from tcpi_rto to tcpi_total_retrans; since Linux 4.6
# (``_TCP_INFO_SENT``) four u64 byte counters, tcpi_segs_out and _in, then tcpi_notsent_bytes.
_TCP_INFO = struct.Struct("=8B24I")
_TCP_INFO_SENT = struct.Struct("=8B24I4Q3I")


def autotune_ceiling(kind: str) -> int:
    """The kernel's autotuning maximum for ``"rmem"`` or ``"wmem"`` (4 MiB when it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/sys/net/ipv4/tcp_{kind}").read_text().split()[2])
    return 4 << 20


def buffer_bytes(bandwidth_bps: float, rtt_s: float) -> int:
    """2 × the bandwidth-delay product in bytes, capped at ``MAX_BUFFER``."""
    return int(min(MAX_BUFFER, 2 * bandwidth_bps / 8 * max(rtt_s, 0.0)))


def tune(sock: socket.socket, bandwidth_bps: float | None = None, rtt_s: float | None = None,
         unsent_bytes: int | None = None) -> None:
    """No Nagle delay (control frames are small); buffers per the module's rule; at most ``unsent_bytes`` held
    unsent when given (``TCP_NOTSENT_LOWAT``). Never fails."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if unsent_bytes:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, unsent_bytes)
    if not bandwidth_bps:
        return
    want = buffer_bytes(bandwidth_bps, rtt_s or DEFAULT_RTT_S)
    for kind, force, plain in (("rmem", _SO_RCVBUFFORCE, socket.SO_RCVBUF),
                               ("wmem", _SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        if want <= autotune_ceiling(kind):
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, want)
        except OSError:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, plain, want)


@dataclass(frozen=True)
class TcpInfo:
    """What the kernel knows about one connection's path (``rtt_us`` smoothed, retransmitted segments)."""

    rtt_us: int
    rttvar_us: int
    total_retrans: int
    lost: int
    snd_cwnd: int
    snd_mss: int
    unacked: int = 0  # segments sent and not yet acknowledged
    notsent_bytes: int = 0  # bytes written that the kernel has not sent yet (0 where the kernel does not say)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tcp_info(sock: socket.socket) -> TcpInfo | None:
    """The socket's ``TCP_INFO`` (Linux), or None where unavailable or the socket is closed."""
    if not hasattr(socket, "TCP_INFO") or sock.fileno() < 0:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SENT.size)
    except OSError:
        return None
    if len(raw) < _TCP_INFO.size:
        return None
    notsent = _TCP_INFO_SENT.unpack(raw)[-1] if len(raw) >= _TCP_INFO_SENT.size else 0
    v = _TCP_INFO.unpack_from(raw)[8:]
    return TcpInfo(rtt_us=v[15], rttvar_us=v[16], total_retrans=v[23], lost=v[6], snd_cwnd=v[18], snd_mss=v[2],
                   unacked=v[4], notsent_bytes=notsent)
