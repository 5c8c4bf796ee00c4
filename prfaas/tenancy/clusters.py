"""Client clusters of a shared prefill pool: who they are, what share of the pool they get, what they may hold.

A decode cluster (router + decode + relay in one datacenter) is a *client* of the prefill pool. From the
``clusters`` config key, read by every prefill instance of the pool and by each router for its own entry::

    clusters:
      east:                          # a cluster name: [a-z0-9_-], at most 64 characters
        key: <16+ characters>        # the credential its router presents (Authorization: Bearer)
        share: 2                     # its weight in each prefill instance's fair queue (by prompt tokens)
        priority: 0                  # a higher class is served first; the fair queue works inside a class
        max_inflight_tokens: 65536   # prompt tokens accepted and not yet finished, per prefill instance; 0 = no cap
        tokens_per_s: 20000          # prompt tokens admitted per second, per prefill instance; 0 = no cap
        datacenter: dc-b             # where its decode runs: the link its KV bytes are billed to ("" = unknown)

A router names its own entry with ``cluster: east`` and sends ``x-prfaas-cluster: east`` and its key on every
``/prefill``. A prefill instance believes the name only with a proof (``ClusterGate.identify``): a verified router
certificate named after the cluster (``spiffe://prfaas/router/east`` or ``…/router/east-…``), or the cluster's
key; anything else is ``KVUnauthorized`` (403, audited). Without ``clusters`` every request is the cluster
``default`` (share 1, no caps), as before the pool had clients.

Quotas (``Admission``) are per prefill instance, checked before a prompt is queued: over either cap the cluster
is told at once (``PoolQuotaExceeded``, 429 with ``Retry-After``), and its router prefills locally. Only names,
never keys, reach logs, metrics and audit records.
"""

from __future__ import annotations

import hmac
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prfaas.errors import InvalidRequest, KVUnauthorized, PoolQuotaExceeded
from prfaas.ratelimit import TokenBucket

DEFAULT_CLUSTER = "default"
CLUSTER_HEADER = "x-prfaas-cluster"
_NAME = re.compile(r"[a-z0-9_-]{1,64}")
_FIELDS = {"key", "share", "priority", "max_inflight_tokens", "tokens_per_s", "datacenter"}


@dataclass(frozen=True)
class ClusterPolicy:
    name: str = DEFAULT_CLUSTER
    key: bytes = field(default=b"", repr=False)  # never printed
    share: float = 1.0
    priority: int = 0
    max_inflight_tokens: int = 0  # 0 = no cap
    tokens_per_s: float = 0.0  # 0 = no cap
    datacenter: str = ""


DEFAULT_POLICY = ClusterPolicy()  # every request of a pool without ``clusters``


def parse_cluster(name: str, spec: Any) -> ClusterPolicy:
    """One cluster's entry; ``InvalidRequest`` naming the cluster and field for anything out of its limits."""
    where = f"clusters.{name}"
    if not _NAME.fullmatch(name):
        raise InvalidRequest(f"{where}: a cluster name is 1-64 characters of a-z, 0-9, _ and -")
    if not isinstance(spec, Mapping | type(None)) or set(spec or {}) - _FIELDS:
        raise InvalidRequest(f"{where}: a mapping of {sorted(_FIELDS)}")
    spec = dict(spec or {})
    key = str(spec.get("key") or "")
    numbers = {k: spec.get(k, 0) for k in ("share", "priority", "max_inflight_tokens", "tokens_per_s")}
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers.values()):
        raise InvalidRequest(f"{where}: share, priority, max_inflight_tokens and tokens_per_s are numbers")
    share = float(spec.get("share", 1.0))
    if key and len(key) < 16:
        raise InvalidRequest(f"{where}.key: at least 16 characters")
    if share <= 0 or numbers["max_inflight_tokens"] < 0 or numbers["tokens_per_s"] < 0:
        raise InvalidRequest(f"{where}: share > 0, max_inflight_tokens and tokens_per_s ≥ 0 (0: no cap)")
    return ClusterPolicy(name, key.encode(), share, int(numbers["priority"]), int(numbers["max_inflight_tokens"]),
                         float(numbers["tokens_per_s"]), str(spec.get("datacenter") or ""))


def parse_clusters(spec: Mapping[str, Any]) -> dict[str, ClusterPolicy]:
    """Every configured cluster; ``InvalidRequest`` for a bad entry or two clusters with one key."""
    clusters = {name: parse_cluster(name, entry) for name, entry in spec.items()}
    keys = [c.key for c in clusters.values() if c.key]
    if len(set(keys)) != len(keys):
        raise InvalidRequest("clusters: two clusters share one key, so neither can be told from the other")
    return clusters


def router_headers(clusters: Mapping[str, ClusterPolicy], name: str) -> dict[str, str]:
    """What a router of cluster ``name`` sends on each ``/prefill``: its name and, when configured, its key."""
    if not name:
        return {}
    policy = clusters.get(name)
    if policy is None:
        raise InvalidRequest(f"cluster: {name!r} has no entry under clusters ({sorted(clusters)})")
    headers = {CLUSTER_HEADER: name}
    if policy.key:
        headers["authorization"] = f"Bearer {policy.key.decode()}"
    return headers


@dataclass(frozen=True)
class ClusterGate:
    """A prefill instance's check of who sends a prompt; stateless."""

    clusters: Mapping[str, ClusterPolicy]

    def identify(self, name: str, authorization: str, cert_role: str | None, cert_name: str) -> ClusterPolicy:
        """The cluster that ``name`` claims, proven by the router's verified certificate (``cert_role`` and
        ``cert_name``) or by ``authorization`` (``Bearer <key>``); ``KVUnauthorized`` otherwise."""
        if not self.clusters:
            return ClusterPolicy()
        policy = self.clusters.get(name)
        if policy is None:
            raise KVUnauthorized(f"cluster {name!r} is not a client of this prefill pool" if name else
                                 f"a prefill request must name its client cluster ({CLUSTER_HEADER})")
        if cert_role == "router" and (cert_name == name or cert_name.startswith(f"{name}-")):
            return policy
        scheme, _, token = authorization.partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        if policy.key and hmac.compare_digest(policy.key, presented):
            return policy
        raise KVUnauthorized(f"cluster {name!r} did not prove its identity (its certificate or key)")


class Admission:
    """Per-cluster caps of one prefill instance: prompt tokens in flight and prompt tokens per second. Called from
    the event loop and released from wherever a prompt ends, so a lock guards the counts."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._inflight: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def admit(self, cluster: ClusterPolicy, tokens: int) -> None:
        """Count ``tokens`` against ``cluster``; ``PoolQuotaExceeded`` (nothing counted) when over a cap."""
        with self._lock:
            held = self._inflight.get(cluster.name, 0)
            if cluster.max_inflight_tokens and held and held + tokens > cluster.max_inflight_tokens:
                raise PoolQuotaExceeded(f"cluster {cluster.name} has {held} prompt tokens in flight here; its quota "
                                        f"is {cluster.max_inflight_tokens}", retry_after_s=1)
            wait = self._take(cluster, tokens)
            if wait > 0:
                raise PoolQuotaExceeded(f"cluster {cluster.name} is over its {cluster.tokens_per_s:g} prompt "
                                        f"tokens/s here", retry_after_s=max(1, math.ceil(wait)))
            self._inflight[cluster.name] = held + tokens

    def release(self, cluster: ClusterPolicy, tokens: int) -> None:
        with self._lock:
            self._inflight[cluster.name] = max(0, self._inflight.get(cluster.name, 0) - tokens)

    def inflight(self, name: str) -> int:
        with self._lock:
            return self._inflight.get(name, 0)

    def _take(self, cluster: ClusterPolicy, tokens: int) -> float:
        """0 when the cluster's bucket holds ``tokens`` (taken), else the seconds until it would (a prompt longer
        than one second's tokens goes from a full bucket, ``TokenBucket.take``)."""
        if not cluster.tokens_per_s:
            return 0.0
        bucket = self._buckets.get(cluster.name)
        if bucket is None:
            bucket = self._buckets[cluster.name] = TokenBucket(cluster.tokens_per_s, clock=self.clock)
        return bucket.take(float(tokens))
