"""Congestion signals, deadlines, the global retry cap and the in-flight bound of a role's data plane (one
``LinkRecorder`` per direction and one ``InflightLimit``, held by the role's ``prfaas.transfer.context``).

For the scheduler (additive, stable): ``LinkRecorder.health() -> LinkStats`` summarises the last minute of
transfers the role made: count, failures, success rate, goodput (payload Gbit/s while transferring), P50/P99
whole-blob seconds, the smoothed TCP RTT and retransmissions seen in ``TCP_INFO``, retries started and refused.
``LinkStats.to_dict()`` is JSON-ready (for a heartbeat or a ``/stats`` reply). The same figures are exported as
``prfaas_transfer_*`` metrics (``prfaas.obs.metrics``). ``LinkRecorder.peers()`` keeps them per peer data address
as well (the last connection's smoothed RTT, the retransmissions summed), for the ``MAX_PEERS`` peers used last:
an instance's heartbeat carries them (``InstanceInfo.tcp_peers``) and the router, which knows each address's
datacenter, feeds the link of that datacenter pair (``prfaas.scheduler.links.Link.observe_tcp``).

Deadline rule (docs/contracts.md): a blob of ``n`` chunks of ``chunk_bytes`` must arrive within ``n × chunk_bytes /
bandwidth + kv_transfer_timeout_ms``, with ``bandwidth`` the goodput measured over the last minute (``FLOOR_BPS`` until
something was measured, so a cold process is not stricter than the link). ``blob_deadline_s`` computes it (given
``LinkRecorder.bandwidth_bps()``); ``pull(deadline_s=…)`` enforces it and fails with ``KV_TIMEOUT``. One chunk's wait is
bounded separately by ``timeout_s`` (the per-chunk "transfer" of the contract).

Global retry cap: a retry is started only while retries in the last minute stay within 1 % of the transfers
started in that minute (at least ``MIN_RETRIES`` a minute, so a quiet role can still heal one reset); beyond,
``allow_retry`` says no and the caller fails (the router falls back), so a bad link cannot start a retry storm.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Any

from prfaas.messages import MAX_RTT_MS, MAX_TCP_PEERS, TcpPeer
from prfaas.obs import metrics
from prfaas.transfer.tcp import TcpInfo

WINDOW_S = 60.0
RETRY_FRACTION = 0.01
MIN_RETRIES = 3
FLOOR_BPS = 1e9  # assumed bandwidth before any measurement (1 Gbit/s)
MAX_PEERS = MAX_TCP_PEERS  # peers whose TCP figures are kept (and sent in a heartbeat): the ones used last


@dataclass(frozen=True)
class LinkStats:
    op: str
    transfers: int
    failures: int
    success_rate: float
    goodput_gbps: float
    p50_ms: float
    p99_ms: float
    rtt_ms: float
    retransmits: int
    retries: int
    retries_refused: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Sample:
    at: float
    ok: bool
    seconds: float
    nbytes: int


class LinkRecorder:
    """The last ``WINDOW_S`` of transfers of one kind (``op``); all calls are cheap and never raise."""

    def __init__(self, op: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.op, self.clock = op, clock
        self._samples: deque[_Sample] = deque(maxlen=100_000)
        self._started: deque[float] = deque(maxlen=100_000)
        self._retries: deque[float] = deque(maxlen=100_000)
        self.retries_refused = 0
        self.rtt_us = 0
        self.retransmits = 0
        self._peers: OrderedDict[str, TcpPeer] = OrderedDict()  # least recently used first

    def started(self) -> None:
        self._started.append(self.clock())

    def finished(self, ok: bool, seconds: float, nbytes: int, code: str = "") -> None:
        self._samples.append(_Sample(self.clock(), ok, seconds, nbytes))
        if ok:
            metrics.TRANSFER_BLOB_SECONDS.labels(op=self.op).observe(seconds)
            metrics.TRANSFER_PAYLOAD_BYTES.labels(op=self.op).inc(nbytes)
        else:
            metrics.TRANSFER_FAILURES.labels(op=self.op, code=code).inc()
        health = self.health()
        metrics.TRANSFER_GOODPUT.labels(op=self.op).set(health.goodput_gbps)
        metrics.TRANSFER_P50.labels(op=self.op).set(health.p50_ms / 1e3)
        metrics.TRANSFER_P99.labels(op=self.op).set(health.p99_ms / 1e3)

    def connection(self, info: TcpInfo | None, retrans_before: int = 0, peer: str = "") -> None:
        """Fold one connection's ``TCP_INFO`` in (at its end); ``peer``: the address it was connected to."""
        if info is None:
            return
        self.rtt_us = info.rtt_us
        added = max(0, info.total_retrans - retrans_before)
        self.retransmits += added
        metrics.TRANSFER_RTT.labels(op=self.op).set(info.rtt_us / 1e6)
        metrics.TRANSFER_RETRANSMITS.labels(op=self.op).inc(added)
        if peer:
            self._peer(peer, info.rtt_us / 1e3, added)

    def _peer(self, peer: str, rtt_ms: float, added: int) -> None:
        before = self._peers.pop(peer, None)
        self._peers[peer] = TcpPeer(peer[:300], min(rtt_ms, MAX_RTT_MS), (before.retransmits if before else 0) + added)
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)

    def peers(self) -> list[TcpPeer]:
        """The TCP figures of the last ``MAX_PEERS`` peers connected to, least recently used first."""
        return list(self._peers.values())

    def allow_retry(self, code: str) -> bool:
        """Whether a new retry may start now (the global cap); counts it when it may."""
        cutoff = self.clock() - WINDOW_S
        started = sum(1 for t in self._started if t >= cutoff)
        recent = sum(1 for t in self._retries if t >= cutoff)
        if recent + 1 > max(MIN_RETRIES, RETRY_FRACTION * started):
            self.retries_refused += 1
            metrics.TRANSFER_RETRIES_REFUSED.inc()
            return False
        self._retries.append(self.clock())
        metrics.TRANSFER_RETRIES.labels(code=code).inc()
        return True

    def bandwidth_bps(self) -> float:
        """Measured goodput in bit/s over the window, ``FLOOR_BPS`` if nothing was measured."""
        return max(FLOOR_BPS, self.health().goodput_gbps * 1e9)

    def health(self) -> LinkStats:
        cutoff = self.clock() - WINDOW_S
        recent = [s for s in self._samples if s.at >= cutoff]
        good = [s for s in recent if s.ok]
        seconds = sum(s.seconds for s in good)
        times = sorted(s.seconds * 1e3 for s in good) or [0.0]
        return LinkStats(
            op=self.op, transfers=len(recent), failures=len(recent) - len(good),
            success_rate=len(good) / len(recent) if recent else 1.0,
            goodput_gbps=sum(s.nbytes for s in good) * 8 / seconds / 1e9 if seconds > 0 else 0.0,
            p50_ms=_quantile(times, 0.5), p99_ms=_quantile(times, 0.99), rtt_ms=self.rtt_us / 1e3,
            retransmits=self.retransmits, retries=sum(1 for t in self._retries if t >= cutoff),
            retries_refused=self.retries_refused)


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def blob_deadline_s(chunks: int, chunk_bytes: int, timeout_ms: float, bandwidth_bps: float = FLOOR_BPS) -> float:
    """The contract's whole-blob deadline in seconds (module docstring); ``bandwidth_bps`` is the measured pull
    goodput (``LinkRecorder.bandwidth_bps()``), ``FLOOR_BPS`` before anything was measured."""
    return chunks * chunk_bytes * 8 / bandwidth_bps + timeout_ms / 1e3


class InflightLimit:
    """``max_inflight_kv``: at most ``limit`` blobs in flight; more callers wait (back-pressure, never an
    unbounded queue of buffers). One per role, used from its event loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._sem = asyncio.Semaphore(limit)
        self.inflight = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        async with self._sem:
            self.inflight += 1
            metrics.TRANSFER_INFLIGHT.inc()
            try:
                yield
            finally:
                self.inflight -= 1
                metrics.TRANSFER_INFLIGHT.dec()


@contextlib.asynccontextmanager
async def maybe_slot(limit: InflightLimit | None) -> AsyncIterator[None]:
    if limit is None:
        yield
    else:
        async with limit.slot():
            yield
