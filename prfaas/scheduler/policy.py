"""``Scheduler``: the router's decisions for one request — admit, route (remote or local, and why), place.

Selective offload: a request goes to remote prefill only if its uncached prompt is longer than
``offload_threshold_tokens``, a prefill instance (and, in relay mode, a relay) is healthy and allowed by its
breaker, and the link is healthy (``LinkMonitor``). "Uncached" counts what the decode instance would compute:
the prompt less the prefix its heartbeat says it holds (``placement.PromptPrefix``); the cost policy likewise times
each route's prefill by what its instance lacks. Otherwise it is prefilled on the decode instance, unless
``fallback_local_prefill`` is off, in which case a remote-sized prompt without a remote path is refused.

A tenant's policy (``prfaas.tenancy``) narrows the choice before anything else is weighed: only prefill instances
and relays in datacenters that may hold its KV, and none outside ``home`` when its prompt may not leave it. With
no instance left, the request stays local, with the policy's reason, whatever ``fallback_local_prefill`` says.
A prefill instance that refused this router's cluster over its pool quota is left out until its ``Retry-After``
has passed (``prfaas.scheduler.quota``); with none left the request stays local (``pool_quota``) without asking.

Every (prefill datacenter, decode datacenter) pair is its own link (``prfaas.scheduler.links``): a degraded link
keeps the requests of that pair local, and no other. ``offload_policy: cost`` replaces the last step (over the
threshold → remote) with the online cost model (``prfaas.scheduler.cost``): the threshold is then a floor, a
request the link's budget has no room for (``link_share`` of its bandwidth, ``prfaas.scheduler.links``) stays
local (``link_busy``), and otherwise the route with the lower predicted TTFT wins, the reason code naming the
term that decided.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from prfaas.config import RouterConfig
from prfaas.errors import KVUnavailable, PoolQuotaExceeded, RateLimited
from prfaas.messages import InstanceInfo
from prfaas.ratelimit import TokenBucket
from prfaas.scheduler.breaker import CircuitBreaker
from prfaas.scheduler.codecs import parse_codecs
from prfaas.scheduler.cost import Inputs
from prfaas.scheduler.links import Link, LinkKey, Links, link_name
from prfaas.scheduler.offload import Estimator, Ticket, load_profile
from prfaas.scheduler.placement import PromptPrefix, decode_candidates, pick_decode, pick_prefill
from prfaas.scheduler.quota import QuotaHolds
from prfaas.scheduler.speed import PrefillSpeed
from prfaas.tenancy.clusters import DEFAULT_CLUSTER
from prfaas.tenancy.policy import TenantPolicy

REMOTE, LOCAL = "remote", "local"
LINK_BOUND = ("cost_transfer", "link_busy")  # the link, not compute, kept the request local


@dataclass(frozen=True)
class Decision:
    route: str
    reason_code: str  # a short, fixed vocabulary: safe as a metric label
    reason: str
    prefill: InstanceInfo | None = None
    relay: InstanceInfo | None = None
    link: LinkKey | None = None  # the link a remote route uses
    kv_bytes: float = 0.0  # its predicted KV bytes on that link (cost policy; 0 under the threshold policy)
    codec: str = ""  # a lossy KV codec chosen for the link (adaptive_codec); "" = the tenant's or deployment's


class Scheduler:
    def __init__(self, config: RouterConfig, mode: str, rng: random.Random | None = None, chunk_bytes: int = 4 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config  # the router's section only: admission, thresholds, decode queue limit
        self.mode = mode
        self.rng = rng or random.Random()
        self.chunk_bytes = chunk_bytes
        self.breakers = CircuitBreaker()
        self.links = Links(config.degrade_p99_ms, config.success_rate_threshold, config.link_bandwidth_bps, clock,
                           config.link_share)
        self.bucket = TokenBucket(config.rate_limit_qps)
        self.estimator = _estimator(config)
        self.codecs = parse_codecs(config.adaptive_codec)
        self.speeds: dict[str, PrefillSpeed] = self.estimator.remote_speeds
        self.cluster = config.cluster or DEFAULT_CLUSTER  # the client cluster this router's prompts count against
        self.quota = QuotaHolds(clock)  # prefill instances that refused this cluster over quota, until Retry-After

    def admit(self) -> None:
        """Raise ``RateLimited`` (429, ``Retry-After``) when the cluster's token bucket is empty."""
        wait = self.bucket.take()
        if wait > 0:
            raise RateLimited(f"over the rate limit of {self.config.rate_limit_qps:g} requests/s",
                              retry_after_s=TokenBucket.retry_after(wait))

    def decode_for(self, instances: list[InstanceInfo], need_kv_bytes: int,
                   prompt: PromptPrefix | None = None) -> InstanceInfo | None:
        """The decode instance with room, preferring one holding ``prompt``'s prefix (``placement``)."""
        candidates = decode_candidates(instances, need_kv_bytes, self.config.decode_queue_limit,
                                       self.breakers.allow)
        return pick_decode(candidates, self.rng, prompt, self.estimator.local_speed)

    def route(self, tokens: int, prefills: list[InstanceInfo], relays: list[InstanceInfo],
              tenant: TenantPolicy | None = None, home: str = "", decode: InstanceInfo | None = None,
              codec: str = "", prompt: PromptPrefix | None = None) -> Decision:
        """Remote or local for a prompt of ``tokens``, to be decoded on ``decode`` (in datacenter ``home``) with
        its KV in ``codec``; the cost policy needs ``decode`` (without it, it decides as the threshold policy).
        ``prompt`` (its ids and tenant) lets cached prefixes count: only uncached tokens are weighed."""
        threshold = self.config.offload_threshold_tokens
        uncached = tokens - (prompt.held(decode) if prompt is not None and decode is not None else 0)
        if uncached <= threshold:
            what = f"{tokens} tokens" if uncached == tokens else f"{tokens} tokens, {uncached} not cached on the " \
                "decode instance,"
            return Decision(LOCAL, "below_threshold", f"prompt of {what} is within the offload threshold of "
                            f"{threshold}")
        if tenant is not None:
            refusal = _narrow(tenant, home, prefills, relays if self.mode == "relay" else [])
            if isinstance(refusal, Decision):
                return refusal
            prefills, relays = refusal
        askable = self._quota_held(prefills)
        if isinstance(askable, Decision):
            return askable
        prefills = askable
        for candidate in prefills:  # an instance not heard from yet starts at its side's profile
            self.estimator.remote_speed(candidate.instance_id)
        prefill = pick_prefill(prefills, tokens, self.speeds, self.breakers.allow, prompt)
        relay = pick_decode(relays, self.rng) if self.mode == "relay" else None
        if prefill is None:
            return self._no_remote("no_prefill", "no healthy prefill instance")
        if self.mode == "relay" and relay is None:
            return self._no_remote("no_relay", "no healthy relay")
        link = self.links.get(prefill.datacenter, home)
        ok, why = link.monitor.allow_remote()
        if not ok:
            return self._no_remote("link_degraded", f"link degraded: {why}")
        if self.config.offload_policy == "cost" and decode is not None:
            held = (prompt.held(prefill), tokens - uncached) if prompt is not None else (0, 0)
            return self._by_cost(tokens, prefill, relay, decode, link, codec, tenant.name if tenant else "default",
                                 held)
        return Decision(REMOTE, "over_threshold", f"prompt of {tokens} tokens is over the offload threshold of "
                        f"{threshold}", prefill, relay, link.key)

    def _quota_held(self, prefills: list[InstanceInfo]) -> Decision | list[InstanceInfo]:
        """``prefills`` less those that refused this cluster over quota within their ``Retry-After``; a local
        ``Decision`` (``pool_quota``) when that leaves none, so the request is not sent only to be refused again."""
        free = [p for p in prefills if not self.quota.held(p.instance_id, self.cluster)]
        if free or not prefills:
            return free
        ids = [p.instance_id for p in prefills]
        wait = self.quota.retry_after(ids, self.cluster)
        why = f"cluster {self.cluster} is over its quota on every prefill instance it may use for {wait} s more"
        if not self.config.fallback_local_prefill:
            raise PoolQuotaExceeded(f"{why}, and fallback_local_prefill is off", retry_after_s=wait)
        return Decision(LOCAL, "pool_quota", f"{why} (remembered Retry-After); prefilled locally")

    def _by_cost(self, tokens: int, prefill: InstanceInfo, relay: InstanceInfo | None, decode: InstanceInfo,
                 link: Link, codec: str, tenant: str, held: tuple[int, int] = (0, 0)) -> Decision:
        """The cost model's route; ``held``: the prompt's tokens cached on the prefill and on the decode instance
        (each route's prefill computes only the rest, and the blob leaves out what decode holds)."""
        kv = self.estimator.kv_bytes(tokens, decode, codec, held[1])
        inputs = self.estimator.inputs(tokens, kv, prefill, decode, held)
        lossy = self.codecs.allowed(tenant, decode.model) if self.codecs is not None else []
        verdict = link.decide(inputs, self.chunk_bytes, record=not lossy)
        if lossy and verdict.route == LOCAL and verdict.code in LINK_BOUND:
            compressed = self._compressed(tokens, inputs, decode, link, lossy, kv, held[1])
            if compressed is not None:
                return replace(compressed, prefill=prefill, relay=relay)
        if lossy:  # no codec taken: the plain candidate joins the link's ranking after all
            verdict = link.decide(inputs, self.chunk_bytes)
        if verdict.code == "link_busy":
            return Decision(LOCAL, "link_busy", f"{verdict.explain()}, but link {link_name(link.key)} (estimated "
                            f"{link.bandwidth.estimate_bps / 1e9:.2f} Gbit/s) has no room for its {kv / 2**20:.1f} "
                            f"MiB within {self.config.link_share:.0%} of its bandwidth")
        if verdict.route == LOCAL:
            return Decision(LOCAL, verdict.code, verdict.explain())
        return Decision(REMOTE, verdict.code, verdict.explain(), prefill, relay, link.key, kv)

    def _compressed(self, tokens: int, inputs: Inputs, decode: InstanceInfo, link: Link,
                    lossy: list[tuple[str, float]], plain_kv: float, decode_held: int) -> Decision | None:
        """The request remote with the best-agreeing lossy codec that makes the remote route win, if any."""
        for name, agreement in lossy:
            kv = self.estimator.kv_bytes(tokens, decode, name, decode_held)
            if kv >= plain_kv:
                continue  # no measured size for it in the profile, or no smaller
            trial = replace(inputs, kv_bytes=kv, restore_s=self.estimator.restore_s_per_byte * kv)
            if link.decide(trial, self.chunk_bytes, record=False).route != REMOTE:
                continue
            verdict = link.decide(trial, self.chunk_bytes)
            return Decision(REMOTE, "link_codec", f"the link is the bottleneck: KV in {name} (measured agreement "
                            f"{agreement:.1%}), {kv / 2**20:.1f} MiB instead of {plain_kv / 2**20:.1f} MiB; "
                            f"{verdict.explain()}", link=link.key, kv_bytes=kv, codec=name)
        return None

    def begin(self, decision: Decision, decode: InstanceInfo, tokens: int) -> Ticket:
        """Count a routed request in the backlog of the instance that prefills it, and its KV on its link, until
        the ticket is closed (its first token, or its end)."""
        if decision.route == REMOTE and decision.prefill is not None and decision.link is not None:
            kv = decision.kv_bytes or self.estimator.kv_bytes(tokens, decode, "")
            return self.estimator.ticket(decision.prefill, tokens, self.links.get(*decision.link), kv)
        return self.estimator.ticket(decode, tokens)

    def transfer_done(self, ticket: Ticket | None, ok: bool, kv_bytes: int = 0, exposed_s: float = 0.0,
                      restore_s: float | None = None, prefill_s: float = 0.0) -> None:
        """A remote transfer's outcome, for its link's monitor and bandwidth estimate (``prefill_s``: the forward
        pass the blob streamed beside)."""
        if ticket is None or ticket.link is None:
            return
        ticket.link.monitor.record(ok=ok, exposed_ms=exposed_s * 1e3)
        if ok:
            ticket.link.transfer_done(kv_bytes, exposed_s, self.chunk_bytes, prefill_s=prefill_s)
        if ok and restore_s is not None:
            self.estimator.observe_restore(kv_bytes, restore_s)

    def _no_remote(self, code: str, why: str) -> Decision:
        if not self.config.fallback_local_prefill:
            raise KVUnavailable(f"{why}, and fallback_local_prefill is off")
        return Decision(LOCAL, code, f"{why}; prefilled locally")

    def prefill_done(self, instance_id: str, tokens: int, seconds: float) -> None:
        self.estimator.remote_speed(instance_id).observe(tokens, seconds)

    def local_prefill_done(self, decode: InstanceInfo, tokens: int, seconds: float) -> None:
        self.estimator.local_speed(decode).observe(tokens, seconds)


def _estimator(config: RouterConfig) -> Estimator:
    remote, ratios = load_profile(config.prefill_profile) if config.prefill_profile else (None, {})
    local = load_profile(config.local_profile)[0] if config.local_profile else None
    return Estimator(remote, local, ratios)


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
