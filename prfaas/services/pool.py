"""The pool side of a prefill instance: which client cluster sent each prompt, whether it may queue more, and
what each cluster used.

``PoolClients`` sits in front of the prefill backend (``prfaas.services.roles.PrefillServer``), whatever engine
it runs: ``identify`` proves the cluster a ``/prefill`` claims (``prfaas.tenancy.clusters.ClusterGate``; a refusal
is ``KVUnauthorized``, 403, written to the audit log with the peer), ``admitted`` counts the prompt against the
cluster's quotas (``PoolQuotaExceeded``, 429 with ``Retry-After``, before anything is queued or a blob exists)
and wraps the backend's events: it gives the quota back once the stream ends, or is dropped unread, and
meters the finished prompt per cluster — prompt tokens, forward-pass seconds, KV bytes on the link to the
cluster's datacenter — into the ``prfaas_pool_*`` metrics and, with ``audit_log`` set, into the instance's own
hash-chained usage log (``pool`` entries; ``prfaas admin usage`` sums them per cluster).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass

from prfaas.audit.chain import ChainLog
from prfaas.config import Config
from prfaas.errors import KVUnauthorized, PoolQuotaExceeded
from prfaas.events import Failed, PrefillDone, PrefillEvent
from prfaas.messages import PrefillRequest
from prfaas.obs import metrics
from prfaas.security.identity import Peer
from prfaas.security.refusals import Record, refused
from prfaas.tenancy.clusters import Admission, ClusterGate, ClusterPolicy, parse_clusters
from prfaas.tenancy.metering import POOL


@dataclass(frozen=True)
class PoolUsage:
    """One prompt's use of the pool, or one refusal (``status``: ok, an error code, or ``POOL_QUOTA_EXCEEDED``)."""

    cluster: str
    link: str  # "<prefill datacenter>-><cluster datacenter>"
    status: str
    prompt_tokens: int
    prefill_seconds: float
    kv_bytes: int


class PoolClients:
    """One prefill instance's view of its client clusters; see the module docstring. ``record``: where refusals
    are audited (the instance's store's access log)."""

    def __init__(self, config: Config, instance_id: str, record: Record | None = None) -> None:
        self.clusters = parse_clusters(config.clusters)
        self.gate = ClusterGate(self.clusters)
        self.admission = Admission()
        self.datacenter = config.common.datacenter
        self.record = record
        self.log = ChainLog(usage_log_path(config.store.audit_log, instance_id)) if config.store.audit_log else None
        if self.log is not None:
            self.log.append("open", {"store": f"{instance_id}-pool", "role": "prefill",
                                     "datacenter": self.datacenter, "at_ms": _ms()})

    def identify(self, peer: Peer, claimed: str, authorization: str) -> ClusterPolicy:
        """The cluster ``peer`` proves it is; ``KVUnauthorized`` (audited, counted) when it proves none."""
        try:
            return self.gate.identify(claimed, authorization, peer.role, peer.name)
        except KVUnauthorized as exc:
            label = claimed if claimed in self.clusters else "unknown"  # a label never holds what a peer typed
            metrics.POOL_REFUSED.labels(label, "unauthorized").inc()
            refused(self.record, Peer(peer.role, peer.name or f"cluster:{label}", peer.address), "prefill",
                    exc.message)
            raise

    def admitted(self, cluster: ClusterPolicy, request: PrefillRequest,
                 events: AsyncIterator[PrefillEvent]) -> AsyncIterator[PrefillEvent]:
        """Count the prompt against ``cluster``'s quotas (``PoolQuotaExceeded`` at once when over one) and return
        ``events`` metered. The quota is given back once: when the stream ends, whatever ended it, or when the
        stream is dropped unread (a router that left before the response started never starts it)."""
        tokens = len(request.token_ids)
        try:
            self.admission.admit(cluster, tokens)
        except PoolQuotaExceeded as exc:
            metrics.POOL_REFUSED.labels(cluster.name, "quota").inc()
            self._write(PoolUsage(cluster.name, self._link(cluster), exc.code, tokens, 0.0, 0))
            raise
        metrics.POOL_INFLIGHT_TOKENS.labels(cluster.name).set(self.admission.inflight(cluster.name))
        release = _Once(lambda: self._release(cluster, tokens))
        stream = self._metered(cluster, tokens, events, release)
        weakref.finalize(stream, release)
        return stream

    async def _metered(self, cluster: ClusterPolicy, tokens: int, events: AsyncIterator[PrefillEvent],
                       release: Callable[[], None]) -> AsyncIterator[PrefillEvent]:
        status, done = "cancelled", None
        try:
            async for event in events:
                if isinstance(event, PrefillDone):
                    status, done = "ok", event
                elif isinstance(event, Failed):
                    status = event.code
                yield event
        finally:
            release()
            self._finished(cluster, tokens, status, done)

    def _release(self, cluster: ClusterPolicy, tokens: int) -> None:
        self.admission.release(cluster, tokens)
        metrics.POOL_INFLIGHT_TOKENS.labels(cluster.name).set(self.admission.inflight(cluster.name))

    def _finished(self, cluster: ClusterPolicy, tokens: int, status: str, done: PrefillDone | None) -> None:
        seconds, kv_bytes = (done.prefill_ms / 1e3, done.kv_bytes) if done else (0.0, 0)
        if done is not None:
            metrics.POOL_PROMPT_TOKENS.labels(cluster.name).inc(tokens)
            metrics.POOL_PREFILL_SECONDS.labels(cluster.name).inc(seconds)
            metrics.POOL_KV_BYTES.labels(cluster.name, self._link(cluster)).inc(kv_bytes)
            metrics.POOL_QUEUE_SECONDS.labels(cluster.name).observe(done.queue_ms / 1e3)
        self._write(PoolUsage(cluster.name, self._link(cluster), status, tokens, round(seconds, 6), kv_bytes))

    def _link(self, cluster: ClusterPolicy) -> str:
        return f"{self.datacenter}->{cluster.datacenter}"

    def _write(self, usage: PoolUsage) -> None:
        if self.log is not None:
            self.log.append(POOL, {**asdict(usage), "at_ms": _ms()})

    def close(self) -> None:
        if self.log is not None:
            self.log.append("close", {"store": "pool", "at_ms": _ms()})
            self.log.close()
            self.log = None


class _Once:
    """``call`` the first time this is called, never again."""

    def __init__(self, call: Callable[[], None]) -> None:
        self.call: Callable[[], None] | None = call

    def __call__(self) -> None:
        call, self.call = self.call, None
        if call is not None:
            call()


def usage_log_path(audit_log: str, instance_id: str) -> str:
    """``audit_log`` with ``{instance}`` → ``<instance>-pool`` (else ``.<instance>-pool`` appended): a log of its
    own, apart from the store's, since one writer per file keeps each chain whole."""
    name = f"{instance_id}-pool"
    return audit_log.replace("{instance}", name) if "{instance}" in audit_log else f"{audit_log}.{name}"


def _ms() -> int:
    return int(time.time() * 1000)

