"""``Scheduler``: the router's decisions for one request — admit, route (remote or local, and why), place.

Selective offload: a request goes to remote prefill only if its uncached prompt is longer than
``offload_threshold_tokens``, a prefill instance (and, in relay mode, a relay) is healthy and allowed by its
breaker, and the link is healthy (``LinkMonitor``). Otherwise it is prefilled on the decode instance, unless
``fallback_local_prefill`` is off, in which case a remote-sized prompt without a remote path is refused.

A tenant's policy (``prfaas.tenancy``) narrows the choice before anything else is weighed: only prefill instances
and relays in datacenters that may hold its KV, and none outside ``home`` when its prompt may not leave it. With
no instance left, the request stays local, with the policy's reason, whatever ``fallback_local_prefill`` says.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prfaas.config import RouterConfig
from prfaas.errors import KVUnavailable, RateLimited
from prfaas.messages import InstanceInfo
from prfaas.ratelimit import TokenBucket
from prfaas.scheduler.breaker import CircuitBreaker
from prfaas.scheduler.link import LinkMonitor
from prfaas.scheduler.placement import decode_candidates, pick_decode, pick_prefill
from prfaas.scheduler.speed import PrefillSpeed
from prfaas.tenancy.policy import TenantPolicy

REMOTE, LOCAL = "remote", "local"


@dataclass(frozen=True)
class Decision:
    route: str
    reason_code: str  # a short, fixed vocabulary: safe as a metric label
    reason: str
    prefill: InstanceInfo | None = None
    relay: InstanceInfo | None = None


class Scheduler:
    def __init__(self, config: RouterConfig, mode: str, rng: random.Random | None = None) -> None:
        self.config = config  # the router's section only: admission, thresholds, decode queue limit
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

    def route(self, tokens: int, prefills: list[InstanceInfo], relays: list[InstanceInfo],
              tenant: TenantPolicy | None = None, home: str = "") -> Decision:
        threshold = self.config.offload_threshold_tokens
        if tokens <= threshold:
            return Decision(LOCAL, "below_threshold", f"prompt of {tokens} tokens is within the offload "
                            f"threshold of {threshold}")
        if tenant is not None:
            refusal = _narrow(tenant, home, prefills, relays if self.mode == "relay" else [])
            if isinstance(refusal, Decision):
                return refusal
            prefills, relays = refusal
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


def _narrow(tenant: TenantPolicy, home: str, prefills: list[InstanceInfo], relays: list[InstanceInfo],
            ) -> Decision | tuple[list[InstanceInfo], list[InstanceInfo]]:
    """The prefills and relays ``tenant`` may use, or a local ``Decision`` saying why none is left."""
    refusals = [tenant.offload_refusal(home, p.datacenter, None) for p in prefills]
    allowed = [p for p, why in zip(prefills, refusals, strict=True) if why is None]
    relay_refusals = [tenant.offload_refusal(home, home, r.datacenter) for r in relays]
    allowed_relays = [r for r, why in zip(relays, relay_refusals, strict=True) if why is None]
    for candidates, whys, everything in ((allowed, refusals, prefills), (allowed_relays, relay_refusals, relays)):
        if everything and not candidates:
            code, why = next(w for w in whys if w is not None)
            return Decision(LOCAL, code, f"{why}; prefilled locally")
    return allowed, allowed_relays
