"""The probe's tiny wire protocol: one JSON line names the operation, then raw bytes."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

ECHO = struct.Struct("!Qd")  # sequence number, sender's monotonic time
MAX_LINE = 4096


def send_line(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def read_line(sock: socket.socket) -> dict[str, Any]:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("peer closed before a full line")
        buf += chunk
        if len(buf) > MAX_LINE:
            raise ConnectionError("line too long")
    obj = json.loads(buf)
    if not isinstance(obj, dict):
        raise ConnectionError("not a JSON object")
    return obj


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)
