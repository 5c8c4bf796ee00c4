"""``run_probe``: the client side of ``prfaas probe run``. Every loop is bounded in count and time."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from prfaas.errors import Unreachable
from prfaas.probe.mtu import path_mtu
from prfaas.probe.stats import jitter, percentile
from prfaas.probe.wire import ECHO, read_line, recv_exact, send_line

Progress = Callable[[str, float], None]
SEND = 1 << 20
UDP = struct.Struct("!Qd")


@dataclass(frozen=True)
class ProbeConfig:
    streams: int = 4
    warmup_s: float = 1.0
    seconds: float = 5.0
    rtt_count: int = 200
    rtt_interval_s: float = 0.005
    udp_count: int = 1000
    udp_interval_s: float = 0.001
    udp_size: int = 512
    connect_timeout_s: float = 5.0


@dataclass(frozen=True)
class ProbeResult:
    target: str
    bandwidth_bps: float
    streams: int
    warmup_s: float
    seconds: float
    rtt_p50_ms: float
    rtt_p99_ms: float
    rtt_min_ms: float
    rtt_max_ms: float
    jitter_ms: float
    loss: float
    udp_sent: int
    udp_received: int
    mtu: int
    mtu_source: str
    per_stream_bps: list[float] = field(default_factory=list)
    rtt_samples: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _connect(host: str, port: int, cfg: ProbeConfig) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=cfg.connect_timeout_s)
    except OSError as exc:
        raise Unreachable(f"cannot connect to a probe server at {host}:{port} ({exc.strerror or exc}); is "
                          f"`prfaas probe serve --port {port}` running there?") from exc


def check_reachable(host: str, port: int, cfg: ProbeConfig) -> None:
    """Connect once and close (the server drops a connection that sends nothing); ``Unreachable`` when it fails,
    so a probe to nothing says so before it draws any progress."""
    _connect(host, port, cfg).close()


def measure_rtt(host: str, port: int, cfg: ProbeConfig, progress: Progress) -> list[float]:
    out: list[float] = []
    with _connect(host, port, cfg) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_line(sock, {"op": "echo"})
        for seq in range(cfg.rtt_count):
            t0 = time.perf_counter()
            sock.sendall(ECHO.pack(seq, t0))
            recv_exact(sock, ECHO.size)
            out.append((time.perf_counter() - t0) * 1e3)
            progress("rtt", (seq + 1) / cfg.rtt_count)
            time.sleep(cfg.rtt_interval_s)
    return out


def _stream(host: str, port: int, cfg: ProbeConfig, results: list[float], i: int) -> None:
    with _connect(host, port, cfg) as sock:
        sock.settimeout(cfg.warmup_s + cfg.seconds + 30)
        send_line(sock, {"op": "sink", "warmup_s": cfg.warmup_s})
        payload = memoryview(b"\0" * SEND)
        end = time.monotonic() + cfg.warmup_s + cfg.seconds
        while time.monotonic() < end:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        reply = read_line(sock)
        secs = float(reply["seconds"])
        results[i] = float(reply["bytes"]) * 8 / secs if secs > 0 else 0.0


def measure_bandwidth(host: str, port: int, cfg: ProbeConfig, progress: Progress) -> list[float]:
    results = [0.0] * cfg.streams
    threads = [threading.Thread(target=_stream, args=(host, port, cfg, results, i), daemon=True)
               for i in range(cfg.streams)]
    for t in threads:
        t.start()
    total = cfg.warmup_s + cfg.seconds
    start = time.monotonic()
    while any(t.is_alive() for t in threads) and time.monotonic() - start < total + 35:
        progress("bandwidth", min((time.monotonic() - start) / total, 1.0))
        time.sleep(0.1)
    progress("bandwidth", 1.0)
    return results


def measure_loss(host: str, port: int, cfg: ProbeConfig, rtt_ms: float, progress: Progress) -> int:
    """Datagrams echoed back out of ``udp_count`` sent (loss is round trip)."""
    got: set[int] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        sock.settimeout(0.05)
        pad = b"\0" * max(cfg.udp_size - UDP.size, 0)
        for seq in range(cfg.udp_count):
            sock.send(UDP.pack(seq, time.perf_counter()) + pad)
            _drain(sock, got)
            progress("loss", (seq + 1) / cfg.udp_count)
            time.sleep(cfg.udp_interval_s)
        end = time.monotonic() + max(0.5, 3 * rtt_ms / 1e3)
        while len(got) < cfg.udp_count and time.monotonic() < end:
            _drain(sock, got, block=True)
    return len(got)


def _drain(sock: socket.socket, got: set[int], block: bool = False) -> None:
    sock.setblocking(block)
    if block:
        sock.settimeout(0.05)
    try:
        for _ in range(10_000):
            data = sock.recv(65535)
            if len(data) >= UDP.size:
                got.add(UDP.unpack_from(data)[0])
            sock.setblocking(False)
    except (BlockingIOError, TimeoutError, ConnectionRefusedError):
        pass


def run_probe(host: str, port: int, cfg: ProbeConfig | None = None,
              progress: Progress | None = None) -> ProbeResult:
    cfg = cfg or ProbeConfig()
    step = progress or (lambda name, frac: None)
    rtts = measure_rtt(host, port, cfg, step)
    per_stream = measure_bandwidth(host, port, cfg, step)
    p50 = percentile(rtts, 50)
    received = measure_loss(host, port, cfg, percentile(rtts, 99), step)
    mtu, how = path_mtu(host, port)
    step("mtu", 1.0)
    return ProbeResult(
        target=f"{host}:{port}", bandwidth_bps=sum(per_stream), streams=cfg.streams, warmup_s=cfg.warmup_s,
        seconds=cfg.seconds, rtt_p50_ms=p50, rtt_p99_ms=percentile(rtts, 99), rtt_min_ms=min(rtts),
        rtt_max_ms=max(rtts), jitter_ms=jitter(rtts), loss=1 - received / cfg.udp_count,
        udp_sent=cfg.udp_count, udp_received=received, mtu=mtu, mtu_source=how,
        per_stream_bps=per_stream, rtt_samples=len(rtts))
