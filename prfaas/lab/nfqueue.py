"""A minimal NFQUEUE client over raw netlink (no libnetfilter_queue): bind a queue, read packet ids, give verdicts.

Only packet metadata is copied to user space (``NFQNL_COPY_META``) and GSO packets stay whole (``NFQA_CFG_F_GSO``),
so one Python process can hold a Gbit-class flow. The socket belongs to the network namespace in which it was
created. Errors from the kernel (no such queue support, queue bound by another process) raise ``OSError``.
"""

from __future__ import annotations

import socket
import struct

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 1, 2, 3
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND = 1
COPY_META = 1
F_GSO = 4
ATTR_PACKET_HDR, ATTR_VERDICT_HDR = 1, 2
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NLMSG = struct.Struct("=IHHII")
NLATTR = struct.Struct("=HH")
NFGEN = struct.Struct("=BBH")  # family, version, res_id (big-endian, packed by hand)


def _attr(kind: int, payload: bytes) -> bytes:
    raw = NLATTR.pack(NLATTR.size + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(msg: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = NFGEN.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return NLMSG.pack(NLMSG.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


class NfQueue:
    """One bound queue number. ``read()`` returns the packet ids waiting on the socket (non-blocking);
    ``accept_upto(id)`` accepts every queued packet with an id ≤ ``id`` in one batch verdict."""

    def __init__(self, queue: int, maxlen: int = 1 << 16) -> None:
        self.queue = queue
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((0, 0))
        self._seq = 0
        self._request(_attr(CFG_CMD, struct.pack("!BxH", CMD_BIND, socket.AF_INET)))
        self._request(_attr(CFG_PARAMS, struct.pack("!IB", 0xFFFF, COPY_META)) + b"")
        self._request(_attr(CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen)))
        self._request(_attr(CFG_FLAGS, struct.pack("!I", F_GSO)) + _attr(CFG_MASK, struct.pack("!I", F_GSO)))
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def _request(self, attrs: bytes) -> None:
        self._seq += 1
        self.sock.send(_message(MSG_CONFIG, self.queue, attrs, NLM_F_REQUEST | NLM_F_ACK, self._seq))
        reply = self.sock.recv(4096)
        _, kind, _, _, _ = NLMSG.unpack_from(reply)
        if kind == NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", reply, NLMSG.size)
            if errno:
                raise OSError(-errno, f"nfqueue {self.queue}: config refused by the kernel")

    def read(self, limit: int = 4096) -> list[int]:
        """Packet ids now waiting, in arrival order (at most ``limit``; never blocks)."""
        ids: list[int] = []
        while len(ids) < limit:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                break
            ids += _packet_ids(data)
        return ids

    def accept_upto(self, packet_id: int) -> None:
        verdict = _attr(ATTR_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))
        self.sock.send(_message(MSG_VERDICT_BATCH, self.queue, verdict))

    def close(self) -> None:
        self.sock.close()


def _packet_ids(data: bytes) -> list[int]:
    ids, offset = [], 0
    while offset + NLMSG.size <= len(data):
        length, kind, _, _, _ = NLMSG.unpack_from(data, offset)
        if length < NLMSG.size:
            break
        if kind & 0xFF == MSG_PACKET and kind >> 8 == NFNL_SUBSYS_QUEUE:
            packet_id = _find_packet_id(data, offset + NLMSG.size + NFGEN.size, offset + length)
            if packet_id is not None:
                ids.append(packet_id)
        offset += (length + 3) & ~3
    return ids


def _find_packet_id(data: bytes, start: int, end: int) -> int | None:
    while start + NLATTR.size <= end:
        length, kind = NLATTR.unpack_from(data, start)
        if length < NLATTR.size:
            return None
        if kind & 0x7FFF == ATTR_PACKET_HDR:
            return int(struct.unpack_from("!I", data, start + NLATTR.size)[0])
        start += (length + 3) & ~3
    return None
