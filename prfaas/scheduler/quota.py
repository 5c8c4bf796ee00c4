"""``QuotaHolds``: what the router remembers of a prefill instance's refusals over a client cluster's quota.

A prefill instance that refuses a cluster's prompt over quota (429 ``POOL_QUOTA_EXCEEDED``) says when to ask again
(``Retry-After``). Until then the answer is known: asking again costs a WAN round trip for another fast 429 and
the request's local prefill starts that much later. So the router keeps the deadline per (prefill instance, client
cluster) — quotas are per cluster and per instance (``prfaas.tenancy.clusters.Admission``), so another instance of
the pool may still have room — and leaves a held instance out of placement until the deadline passes. When every
prefill instance the request could use is held, it is prefilled locally at once (reason code ``pool_quota``),
without asking.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class QuotaHolds:
    """Deadlines by (instance id, cluster); expired ones are dropped when read. Not thread-safe: the router's
    event loop is its only user."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._until: dict[tuple[str, str], float] = {}

    def hold(self, instance_id: str, cluster: str, retry_after_s: float) -> None:
        """Remember a refusal: ``instance_id`` refuses ``cluster`` for ``retry_after_s`` more seconds (a later
        deadline never shortens an earlier one)."""
        key = (instance_id, cluster)
        self._until[key] = max(self._until.get(key, 0.0), self.clock() + max(0.0, retry_after_s))

    def remaining(self, instance_id: str, cluster: str) -> float:
        """Seconds until ``instance_id`` may be asked again for ``cluster``; 0 when it may be now."""
        key = (instance_id, cluster)
        left = self._until.get(key, 0.0) - self.clock()
        if left <= 0:
            self._until.pop(key, None)
            return 0.0
        return left

    def held(self, instance_id: str, cluster: str) -> bool:
        return self.remaining(instance_id, cluster) > 0

    def retry_after(self, instance_ids: list[str], cluster: str) -> int:
        """The ``Retry-After`` (whole seconds, at least 1) until the first of ``instance_ids`` frees up."""
        return max(1, math.ceil(min((self.remaining(i, cluster) for i in instance_ids), default=0.0)))
