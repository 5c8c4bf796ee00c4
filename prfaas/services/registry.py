"""The router's view of its instances, kept fresh by heartbeats; placement picks from the healthy ones."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prfaas.errors import KVIncompatible
from prfaas.kv import Fingerprint
from prfaas.messages import InstanceInfo
from prfaas.obs import metrics

ROLES = ("prefill", "decode", "relay")
log = logging.getLogger("prfaas.registry")


@dataclass
class _Entry:
    info: InstanceInfo
    last_seen: float


class Registry:
    """Instances by id. The first engine instance fixes the deployment's fingerprint; an instance whose
    fingerprint differs is refused at registration (HTTP 409, ``KV_INCOMPATIBLE``)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self.fingerprint: Fingerprint | None = None

    def upsert(self, info: InstanceInfo) -> None:
        if info.role not in ROLES:
            raise KVIncompatible(f"unknown role {info.role!r}")
        if info.fingerprint:
            fingerprint = Fingerprint.from_wire(info.fingerprint)
            if self.fingerprint is None:
                self.fingerprint = fingerprint
            elif fingerprint.mismatches(self.fingerprint):
                metrics.REFUSED.labels(reason="fingerprint").inc()
                why = (f"{info.instance_id} serves another model than this deployment: its fingerprint differs "
                       f"in {', '.join(fingerprint.mismatches(self.fingerprint))}")
                log.warning("registration refused: %s", why)
                raise KVIncompatible(why)
        self._entries[info.instance_id] = _Entry(info, self.clock())
        metrics.QUEUE_DEPTH.labels(instance=info.instance_id).set(info.queue_depth)
        metrics.FREE_KV.labels(instance=info.instance_id).set(info.free_kv_bytes)
        self._publish()

    def remove(self, instance_id: str) -> None:
        self._entries.pop(instance_id, None)
        self._publish()

    def healthy(self, role: str) -> list[InstanceInfo]:
        now = self.clock()
        return [e.info for e in self._entries.values()
                if e.info.role == role and e.info.ready and now - e.last_seen <= self.timeout_s]

    def all(self) -> list[tuple[InstanceInfo, bool]]:
        now = self.clock()
        return [(e.info, now - e.last_seen <= self.timeout_s) for e in self._entries.values()]

    def _publish(self) -> None:
        for role in ROLES:
            healthy = len(self.healthy(role))
            total = sum(1 for e in self._entries.values() if e.info.role == role)
            metrics.INSTANCES.labels(role=role, healthy="true").set(healthy)
            metrics.INSTANCES.labels(role=role, healthy="false").set(total - healthy)
