"""The router's view of its instances, kept fresh by heartbeats; placement picks from the healthy ones."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prfaas.errors import KVIncompatible
from prfaas.kv import Fingerprint
from prfaas.messages import InstanceInfo
from prfaas.obs import metrics

ROLES = ("prefill", "decode", "relay")


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
                raise KVIncompatible(f"{info.instance_id} serves another model: differs in "
                                     f"{', '.join(fingerprint.mismatches(self.fingerprint))}")
        self._entries[info.instance_id] = _Entry(info, self.clock())
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

    def pick(self, role: str, need_kv_bytes: int = 0, queue_limit: int | None = None) -> InstanceInfo | None:
        """The healthy instance with the shortest queue (then the most free KV memory) that fits."""
        fits = [i for i in self.healthy(role) if i.free_kv_bytes >= need_kv_bytes or role != "decode"]
        if queue_limit is not None:
            fits = [i for i in fits if i.queue_depth < queue_limit]
        return min(fits, key=lambda i: (i.queue_depth, -i.free_kv_bytes), default=None)

    def bump(self, instance_id: str) -> None:
        """Count work we just sent, so back-to-back requests spread before the next heartbeat says so."""
        entry = self._entries.get(instance_id)
        if entry:
            info = entry.info
            entry.info = InstanceInfo(**{**info.to_json(), "queue_depth": info.queue_depth + 1})

    def _publish(self) -> None:
        for role in ROLES:
            healthy = len(self.healthy(role))
            total = sum(1 for e in self._entries.values() if e.info.role == role)
            metrics.INSTANCES.labels(role=role, healthy="true").set(healthy)
            metrics.INSTANCES.labels(role=role, healthy="false").set(total - healthy)
