"""``Scheduler``: the router's decisions for one request — admit, route (remote or local, and why), place.

Selective offload: a request goes to remote prefill only if its uncached prompt is longer than
``offload_threshold_tokens``, a prefill instance (and, in relay mode, a relay) is healthy and allowed by its
breaker, and the link is healthy (``LinkMonitor``). Otherwise it is prefilled on the decode instance, unless
``fallback_local_prefill`` is off, in which case a remote-sized prompt without a remote path is refused.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prfaas.config import Config
from prfaas.errors import KVUnavailable, RateLimited
from prfaas.messages import InstanceInfo
from prfaas.scheduler.breaker import CircuitBreaker
from prfaas.scheduler.link import LinkMonitor
from prfaas.scheduler.placement import decode_candidates, pick_decode, pick_prefill
from prfaas.scheduler.ratelimit import TokenBucket
from prfaas.scheduler.speed import PrefillSpeed

REMOTE, LOCAL = "remote", "local"


@dataclass(frozen=True)
class Decision:
    route: str
    reason_code: str  # a short, fixed vocabulary: safe as a metric label
    reason: str
    prefill: InstanceInfo | None = None
    relay: InstanceInfo | None = None


class Scheduler:
    def __init__(self, config: Config, mode: str, rng: random.Random | None = None) -> None:
        self.config = config
        self.mode = mode
        self.rng = rng or random.Random()
        self.breakers = CircuitBreaker()
        self.link = LinkMonitor(config.degrade_p99_ms, config.success_rate_threshold)
        self.bucket = TokenBucket(config.rate_limit_qps)
        self.speeds: dict[str, PrefillSpeed] = {}

    def admit(self) -> None:
        """Raise ``RateLimited`` (429, ``Retry-After``) when the cluster's token bucket is empty."""
        wait = self.bucket.take()
        if wait > 0:
            raise RateLimited(f"over the rate limit of {self.config.rate_limit_qps:g} requests/s",
                              retry_after_s=TokenBucket.retry_after(wait))

    def decode_for(self, instances: list[InstanceInfo], need_kv_bytes: int) -> InstanceInfo | None:
        candidates = decode_candidates(instances, need_kv_bytes, self.config.decode_queue_limit,
                                       self.breakers.allow)
        return pick_decode(candidates, self.rng)

    def route(self, tokens: int, prefills: list[InstanceInfo], relays: list[InstanceInfo]) -> Decision:
        threshold = self.config.offload_threshold_tokens
        if tokens <= threshold:
            return Decision(LOCAL, "below_threshold", f"prompt of {tokens} tokens is within the offload "
                            f"threshold of {threshold}")
        prefill = pick_prefill(prefills, tokens, self.speeds, self.breakers.allow)
        relay = pick_decode(relays, self.rng) if self.mode == "relay" else None
        if prefill is None:
            return self._no_remote("no_prefill", "no healthy prefill instance")
        if self.mode == "relay" and relay is None:
            return self._no_remote("no_relay", "no healthy relay")
        ok, why = self.link.allow_remote()
        if not ok:
            return self._no_remote("link_degraded", f"link degraded: {why}")
        return Decision(REMOTE, "over_threshold", f"prompt of {tokens} tokens is over the offload threshold of "
                        f"{threshold}", prefill, relay)

    def _no_remote(self, code: str, why: str) -> Decision:
        if not self.config.fallback_local_prefill:
            raise KVUnavailable(f"{why}, and fallback_local_prefill is off")
        return Decision(LOCAL, code, f"{why}; prefilled locally")

    def prefill_done(self, instance_id: str, tokens: int, seconds: float) -> None:
        self.speeds.setdefault(instance_id, PrefillSpeed()).observe(tokens, seconds)
