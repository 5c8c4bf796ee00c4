"""Link health as the router sees it, from the outcome of every remote transfer.

For each remote request the router records success or failure and the *exposed* transfer time: the part of the
KV pull that was not hidden behind the prefill's forward pass (decode's pull time minus the prefill's compute and
queue time). With layer-wise streaming that is about the last chunk's transfer, which is what
``degrade_p99_ms`` (per chunk, docs/contracts.md) bounds. The link is degraded when, over the window, the P99 of that
time exceeds ``degrade_p99_ms`` or the success rate falls below ``success_rate_threshold``; while degraded, new
requests are prefilled locally.

Recovery, like a circuit breaker's half-open state: while degraded, a probe still goes remote every
``probe_interval_s`` seconds (and every ``probe_every``-th request). ``recover_after`` healthy outcomes in a row
(success within ``degrade_p99_ms``) end the episode at once: the samples before them are forgotten, so a link that
came back is used again within seconds, not after the bad samples age out of the window. Any unhealthy outcome
restarts the count.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MIN_SAMPLES = 5


@dataclass(frozen=True)
class LinkHealth:
    samples: int
    success_rate: float
    exposed_p50_ms: float
    exposed_p99_ms: float
    degraded: bool
    reason: str


class LinkMonitor:
    def __init__(self, degrade_p99_ms: float, success_rate_threshold: float, window_s: float = 60.0,
                 max_samples: int = 2000, probe_every: int = 20, probe_interval_s: float = 2.0,
                 recover_after: int = 3, clock: Callable[[], float] = time.monotonic):
        self.degrade_p99_ms = degrade_p99_ms
        self.success_rate_threshold = success_rate_threshold
        self.window_s = window_s
        self.probe_every = probe_every
        self.probe_interval_s = probe_interval_s
        self.recover_after = recover_after
        self.clock = clock
        self._samples: deque[tuple[float, bool, float]] = deque(maxlen=max_samples)
        self._skipped = 0
        self._last_probe = float("-inf")
        self._healthy_run = 0  # healthy outcomes in a row, counted while degraded

    def record(self, ok: bool, exposed_ms: float = 0.0) -> None:
        healthy = ok and exposed_ms <= self.degrade_p99_ms
        counts = healthy and self.health().degraded  # the window is judged only when the outcome could end it
        self._samples.append((self.clock(), ok, max(0.0, exposed_ms)))
        self._healthy_run = self._healthy_run + 1 if counts else 0
        if self._healthy_run >= self.recover_after:  # the link is back: judge it from these outcomes on
            for _ in range(len(self._samples) - self._healthy_run):
                self._samples.popleft()
            self._healthy_run = 0

    def health(self) -> LinkHealth:
        cutoff = self.clock() - self.window_s
        recent = [s for s in self._samples if s[0] >= cutoff]
        if len(recent) < MIN_SAMPLES:
            return LinkHealth(len(recent), 1.0, 0.0, 0.0, False, "not enough samples")
        rate = sum(1 for s in recent if s[1]) / len(recent)
        times = sorted(s[2] for s in recent if s[1]) or [0.0]
        p50, p99 = _quantile(times, 0.5), _quantile(times, 0.99)
        if rate < self.success_rate_threshold:
            return LinkHealth(len(recent), rate, p50, p99, True, f"transfer success rate {rate:.1%} is below "
                              f"{self.success_rate_threshold:.1%}")
        if p99 > self.degrade_p99_ms:
            return LinkHealth(len(recent), rate, p50, p99, True, f"exposed transfer P99 {p99:.0f} ms is over "
                              f"{self.degrade_p99_ms:.0f} ms")
        return LinkHealth(len(recent), rate, p50, p99, False, "healthy")

    def allow_remote(self) -> tuple[bool, str]:
        """Whether the link may take a remote request now, and why not (a probe gets through now and then)."""
        health = self.health()
        if not health.degraded:
            return True, health.reason
        self._skipped += 1
        now = self.clock()
        if self._skipped % self.probe_every == 0 or now - self._last_probe >= self.probe_interval_s:
            self._last_probe = now
            return True, f"probe while degraded: {health.reason}"
        return False, health.reason


def _quantile(values: list[float], q: float) -> float:
    index = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[index]
