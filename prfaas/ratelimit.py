"""Token-bucket rate limit: the router's ``rate_limit_qps``, a tenant's and an API key's own (``prfaas.scheduler``,
``prfaas.tenancy``, ``prfaas.security.apikeys``); the router answers 429 with ``Retry-After`` when one is empty.
Ground floor: it imports nothing of prfaas, so every layer can use it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up. ``take()`` returns 0 when a request may go, else the
    seconds until it could."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic):
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = burst if burst is not None else max(1.0, rate)
        self.clock = clock
        self._tokens = self.burst
        self._at = clock()

    def available(self) -> float:
        """The tokens saved up now (negative while in debt)."""
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens

    def spend(self, amount: float) -> None:
        """Take ``amount`` whatever is left: the bucket may go into debt, repaid at ``rate``."""
        self._tokens = self.available() - amount

    def retune(self, rate: float, burst: float) -> None:
        """A new rate and burst from now on (what was saved up so far at the old rate)."""
        self.available()
        self.rate, self.burst = max(rate, 1e-12), burst
        self._tokens = min(self._tokens, burst)

    def take(self, amount: float = 1.0) -> float:
        """Take ``amount`` tokens (a request: 1; prompt tokens: their count). An amount over ``burst`` goes from a
        full bucket and leaves it in debt, so that no amount waits for ever."""
        tokens = self.available()
        need = min(amount, self.burst)
        if tokens >= need:
            self._tokens -= amount
            return 0.0
        return (need - tokens) / self.rate

    @staticmethod
    def retry_after(wait_s: float) -> int:
        """The ``Retry-After`` header value: whole seconds, at least 1."""
        return max(1, math.ceil(wait_s))
