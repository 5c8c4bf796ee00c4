"""``ProbeServer``: TCP (sink and echo) and UDP (echo) on one port; every socket has a timeout, so a stuck
peer never holds a thread for long, and ``max_seconds`` bounds the whole server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from prfaas.probe.wire import ECHO, read_line, recv_exact, send_line

IDLE_TIMEOUT_S = 30.0
RECV = 1 << 20


class ProbeServer:
    def __init__(self, host: str = "0.0.0.0", port: int = 0, max_seconds: float | None = None) -> None:
        self.tcp = socket.create_server((host, port), reuse_port=False)
        self.port: int = self.tcp.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((host, self.port))
        self.tcp.settimeout(0.2)
        self.udp.settimeout(0.2)
        self.deadline = None if max_seconds is None else time.monotonic() + max_seconds
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def running(self) -> bool:
        return not self._stop.is_set() and (self.deadline is None or time.monotonic() < self.deadline)

    def start(self) -> ProbeServer:
        for target in (self._accept_loop, self._udp_loop):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def wait(self) -> None:
        while self.running():
            time.sleep(0.2)
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self.tcp.close()
        self.udp.close()

    def __enter__(self) -> ProbeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        while self.running():
            try:
                conn, _ = self.tcp.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(IDLE_TIMEOUT_S)
            with contextlib.suppress(OSError, ConnectionError, ValueError):
                head = read_line(conn)
                if head.get("op") == "sink":
                    self._sink(conn, float(head.get("warmup_s", 0.0)))
                elif head.get("op") == "echo":
                    self._echo(conn)

    def _sink(self, conn: socket.socket, warmup_s: float) -> None:
        """Count bytes received after ``warmup_s`` from the first byte, until the sender half-closes."""
        first = start = last = 0.0
        counted = 0
        buf = bytearray(RECV)
        while self.running():
            n = conn.recv_into(buf)
            now = time.monotonic()
            if n == 0:
                break
            if not first:
                first = now
            if now - first >= warmup_s:
                if not start:
                    start = now
                else:
                    counted += n
                last = now
        send_line(conn, {"bytes": counted, "seconds": max(last - start, 0.0)})

    def _echo(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while self.running():
            try:
                frame = recv_exact(conn, ECHO.size)
            except ConnectionError:
                return
            conn.sendall(frame)

    def _udp_loop(self) -> None:
        while self.running():
            try:
                data, addr = self.udp.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            with contextlib.suppress(OSError):
                self.udp.sendto(data, addr)
