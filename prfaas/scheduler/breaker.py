"""Per-instance circuit breaker: closed → open after consecutive failures → half-open after a cool-down."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class _State:
    failures: int = 0
    opened_at: float | None = None
    probe_at: float | None = None  # when the half-open probe was let through


class CircuitBreaker:
    """``allow(id)`` says whether to send work to an instance. After ``threshold`` consecutive failures the
    breaker opens for ``cooldown_s``; then one probe request is let through (half-open): its success closes the
    breaker, its failure opens it again. A probe whose outcome never comes (the caller let it through, then sent
    the request elsewhere, e.g. local because the link was degraded) expires after ``cooldown_s`` and the next
    caller probes: a half-open breaker never waits forever. ``failure`` is for the instance's own faults only
    (unreachable, broken stream, a server-side error code); an instance that refuses a bad request answered
    correctly, and its caller reports ``success`` (``prfaas.services.dispatch``)."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._states: dict[str, _State] = {}

    def state(self, instance_id: str) -> str:
        s = self._states.get(instance_id)
        if s is None or s.opened_at is None:
            return CLOSED
        return HALF_OPEN if self.clock() - s.opened_at >= self.cooldown_s else OPEN

    def allow(self, instance_id: str) -> bool:
        state = self.state(instance_id)
        if state == CLOSED:
            return True
        s = self._states[instance_id]
        now = self.clock()
        if state == HALF_OPEN and (s.probe_at is None or now - s.probe_at >= self.cooldown_s):
            s.probe_at = now
            return True
        return False

    def success(self, instance_id: str) -> None:
        self._states.pop(instance_id, None)

    def failure(self, instance_id: str) -> None:
        s = self._states.setdefault(instance_id, _State())
        s.failures += 1
        s.probe_at = None
        if s.failures >= self.threshold:
            s.opened_at = self.clock()
