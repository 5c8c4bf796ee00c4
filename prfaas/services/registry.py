"""The router's view of its instances, kept fresh by heartbeats; placement picks from the healthy ones.

Pools: instances are grouped by the pool key of their fingerprint (``Fingerprint.pool_key``: everything that must
match for a KV hand-off). Without ``pools`` in the config the first engine instance fixes the deployment's model and
any other fingerprint is refused (HTTP 409, ``KV_INCOMPATIBLE``). With ``pools`` (model name or pool key → weight),
every fingerprint must match an entry, several pools run side by side (a model upgrade), requests go to a pool
with the configured weights (canary) and are paired only inside it. Relays hold no model and serve every pool.
Draining instances stay listed but get no new work.

Owners: each entry remembers who registered it (``prfaas.security.registration``: a certificate, an API key, or
nobody); while the instance is live, a heartbeat or deregistration of its id by another owner is refused
(``KVUnauthorized``), so one instance can neither take over nor remove another. An id whose instance stopped
heartbeating for ``timeout_s`` may be registered again by anyone allowed to claim it (a replacement host).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from prfaas.errors import KVIncompatible, KVUnauthorized, ModelNotFound
from prfaas.kv import Fingerprint
from prfaas.messages import InstanceInfo
from prfaas.obs import metrics

ROLES = ("prefill", "decode", "relay")
log = logging.getLogger("prfaas.registry")


@dataclass
class _Entry:
    info: InstanceInfo
    last_seen: float
    owner: str = ""  # who registered it (registration.Registrar); "" = unauthenticated


def pool_of(info: InstanceInfo) -> str:
    """The instance's pool key; "" for an instance without a model (a relay)."""
    return Fingerprint.from_wire(info.fingerprint).pool_key() if info.fingerprint else ""


class Registry:
    """Instances by id, grouped into pools by fingerprint; see the module docstring for who is refused."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 pools: dict[str, float] | None = None) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.pools = dict(pools or {})
        self._entries: dict[str, _Entry] = {}
        self.fingerprint: Fingerprint | None = None  # the first pool's: the deployment's model by default
        self.models: dict[str, Fingerprint] = {}  # pool key → fingerprint

    def upsert(self, info: InstanceInfo, owner: str = "") -> None:
        """Register or refresh ``info`` for ``owner``; ``KVIncompatible`` for an unknown role or a model this
        deployment does not serve, ``KVUnauthorized`` if another owner holds the live id."""
        if info.role not in ROLES:
            raise KVIncompatible(f"unknown role {info.role!r}")
        self._check_owner(info.instance_id, owner)
        if info.fingerprint:
            self._admit(info.instance_id, Fingerprint.from_wire(info.fingerprint))
        self._entries[info.instance_id] = _Entry(info, self.clock(), owner)
        metrics.QUEUE_DEPTH.labels(instance=info.instance_id).set(info.queue_depth)
        metrics.FREE_KV.labels(instance=info.instance_id).set(info.free_kv_bytes)
        self._publish()

    def seen_at(self, instance_id: str) -> float | None:
        """When (``clock``) the instance's last heartbeat arrived; None for an unknown id."""
        entry = self._entries.get(instance_id)
        return entry.last_seen if entry is not None else None

    def _admit(self, instance_id: str, fingerprint: Fingerprint) -> None:
        key = fingerprint.pool_key()
        if key in self.models:
            return
        if self.pools and self.weight_of(key, fingerprint.model) is None:
            self._refuse(f"{instance_id} serves {fingerprint.model!r} (pool {key}), which matches no entry of "
                         f"the configured pools {sorted(self.pools)}")
        if not self.pools and self.fingerprint is not None:
            bad = fingerprint.mismatches(self.fingerprint)
            self._refuse(f"{instance_id} serves another model than this deployment: its fingerprint differs "
                         f"in {', '.join(bad)} (list both models under `pools` in the config to run them side "
                         f"by side)")
        self.models[key] = fingerprint
        self.fingerprint = self.fingerprint or fingerprint
        log.info("pool %s (%s) opened by %s", key, fingerprint.model, instance_id)

    @staticmethod
    def _refuse(why: str) -> None:
        metrics.REFUSED.labels(reason="fingerprint").inc()
        log.warning("registration refused: %s", why)
        raise KVIncompatible(why)

    def weight_of(self, key: str, model: str) -> float | None:
        """The configured weight of a pool (by pool key, else by model name); without ``pools``, 1."""
        if not self.pools:
            return 1.0
        return self.pools.get(key, self.pools.get(model))

    def mark_draining(self, instance_id: str) -> bool:
        """Stop placing work on an instance now, before its next heartbeat says so; False if unknown."""
        entry = self._entries.get(instance_id)
        if entry is None:
            return False
        entry.info = replace(entry.info, draining=True)
        self._publish()
        return True

    def remove(self, instance_id: str, owner: str = "") -> None:
        """Forget ``instance_id`` (nothing if unknown); ``KVUnauthorized`` if another owner holds it live."""
        self._check_owner(instance_id, owner)
        self._entries.pop(instance_id, None)
        self._publish()

    def _check_owner(self, instance_id: str, owner: str) -> None:
        entry = self._entries.get(instance_id)
        if entry is not None and entry.owner != owner and self.clock() - entry.last_seen <= self.timeout_s:
            log.warning("refused %s for instance %s: it is registered by %s", owner or "an anonymous peer",
                        instance_id, entry.owner or "an anonymous peer")
            raise KVUnauthorized(f"instance id {instance_id!r} is registered by another identity")

    def healthy(self, role: str, pool: str | None = None) -> list[InstanceInfo]:
        """Instances that can take new work: heard from lately, ready, not draining, and (with ``pool``) of
        that pool or of none (relays)."""
        now = self.clock()
        return [e.info for e in self._entries.values()
                if e.info.role == role and e.info.ready and not e.info.draining
                and now - e.last_seen <= self.timeout_s
                and (pool is None or not e.info.fingerprint or pool_of(e.info) == pool)]

    def choose_pool(self, model: str, rng: random.Random) -> str:
        """The pool a new request goes to: the one ``model`` names (a model name, pool key or root), else a draw by
        the configured weights among pools with a healthy decode instance; a name that several live pools share (a
        rolling upgrade keeps the name) is drawn among them by weight; ``ModelNotFound`` (404) for a name no pool
        has. "" only while no model is known."""
        live = {pool_of(i) for i in self.healthy("decode")} & set(self.models)
        if model:
            named = sorted(k for k in self.models if model in (k, self.models[k].model, *self.roots(k)))
            if not named and self.models:
                raise ModelNotFound(f"The model `{model}` does not exist or is not served here; this deployment serves "
                                    f"{sorted({f.model for f in self.models.values()})}")
            serving = [k for k in named if k in live]  # one name, several pools: an upgrade in progress
            if len(serving) < 2:
                return next(iter(serving), named[0] if named else "")
            live = set(serving)
        weights = {k: self.weight_of(k, self.models[k].model) or 0.0 for k in sorted(live)}
        if not weights or sum(weights.values()) <= 0:
            return next(iter(weights), next(iter(sorted(self.models)), ""))
        return rng.choices(list(weights), weights=list(weights.values()))[0]

    def roots(self, pool: str) -> list[str]:
        """The directories that the live decode instances of ``pool`` load their tokenizer from (``model_root``):
        what ``/v1/models`` names as the model's ``root``, and another name a request may give the model by."""
        return sorted({i.model_root for i in self.healthy("decode", pool) if i.model_root})

    def all(self) -> list[tuple[InstanceInfo, bool]]:
        now = self.clock()
        return [(e.info, now - e.last_seen <= self.timeout_s) for e in self._entries.values()]

    def _publish(self) -> None:
        for role in ROLES:
            healthy = len(self.healthy(role))
            total = sum(1 for e in self._entries.values() if e.info.role == role)
            metrics.INSTANCES.labels(role=role, healthy="true").set(healthy)
            metrics.INSTANCES.labels(role=role, healthy="false").set(total - healthy)
            draining = sum(1 for e in self._entries.values() if e.info.role == role and e.info.draining)
            metrics.DRAINING.labels(role=role).set(draining)
