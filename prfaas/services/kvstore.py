"""A role's KV store as a running part of its process (relay; prefill in direct mode): the ``BlobStore`` on the
configured backend, its audit log, its metrics, the data-plane server that records who each peer is, and the
views for ``/stats`` and ``/debug/store``.

Lifecycle: ``StoreRuntime(config, instance_id)`` opens the audit log (an ``open`` entry), connects the backend
(Redis: ``KVUnavailable`` if unreachable), builds the store (adopting what a killed predecessor left in Redis) and
records the end of blobs the log shows alive that nobody holds any more; ``sweep`` every second; ``close`` at
shutdown ends every blob left (``shutdown``) and closes the log with a ``close`` entry.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from prfaas.audit import AuditLog
from prfaas.config import Config, StoreConfig
from prfaas.obs import metrics
from prfaas.security.runtime import PLAINTEXT, Security
from prfaas.store import AccessRecord, BlobStore, DeletionRecord, FrameBackend, MemoryBackend, accessing
from prfaas.store.sealed import SealedBackend, load_master_key
from prfaas.tenancy import Tenants, metering
from prfaas.transfer import TransferServer

log = logging.getLogger("prfaas.store")


def longest_ttl(config: Config) -> float:
    """The longest TTL a blob of this deployment may have: ``kv_ttl_seconds`` or a tenant's longer override.
    The store cuts a longer TTL asked on the wire to it (so store holders want the tenants' policies too)."""
    tenants = Tenants.from_config(config.tenants).policies.values()
    return max([config.store.kv_ttl_seconds, *(t.kv_ttl_seconds for t in tenants)])


class StoreRuntime:
    def __init__(self, config: Config, instance_id: str) -> None:
        """``config``: the root, of which the store reads its section, ``datacenter``, ``tenants`` and ``limits``."""
        section = config.store
        self.instance_id, self.datacenter = instance_id, config.common.datacenter
        self.audit = AuditLog(section.audit_log.replace("{instance}", instance_id), instance_id) \
            if section.audit_log else None
        backend = _backend(section, instance_id)
        if self.audit:
            self.audit.opened(backend=backend.name, ttl_s=section.kv_ttl_seconds,
                              budget_bytes=section.store_budget_bytes, datacenter=self.datacenter)
        self.store = BlobStore(section.store_budget_bytes, section.kv_ttl_seconds, on_delete=self._deleted,
                               backend=backend, on_access=self._accessed, owner=instance_id,
                               max_ttl_s=longest_ttl(config), limits=config.limits)
        if self.audit:
            settled = self.audit.settle({b.kv_id for b in self.store.live()}, section.kv_ttl_seconds)
            if settled:
                log.warning("recorded the end of %d blobs a previous store process never recorded", settled)
        metrics.STORE_BUDGET_BYTES.set(section.store_budget_bytes)

    def server(self, host: str, port: int, security: Security = PLAINTEXT) -> TransferServer:
        """The data-plane server; with the role's TLS (``security``) it is mutual TLS 1.3 and each request is
        authorised by the peer's role, refusals recorded in the audit log."""
        from prfaas.security.dataplane import DataPlaneGuard

        ssl = security.server_ssl()
        guard = DataPlaneGuard(security.required(), self._accessed) if ssl is not None else None
        return IdentifiedTransferServer(self.store, host=host, port=port, ssl=ssl, authorize=guard,
                                        on_tls_refused=guard.tls_refused if guard else None)

    def sweep(self) -> None:
        self.store.sweep()
        self._gauges()

    def _gauges(self) -> None:
        stats = self.store.stats()
        metrics.STORE_LIVE_BLOBS.labels(state="writing").set(stats.writing)
        metrics.STORE_LIVE_BLOBS.labels(state="ready").set(stats.ready)
        metrics.STORE_LIVE_BYTES.set(stats.bytes)
        metrics.STORE_READERS.set(stats.readers)
        if self.audit:
            metrics.STORE_AUDIT_FAILURES.set(self.audit.chain.failures)

    def close(self) -> list[DeletionRecord]:
        left = self.store.close()
        if self.audit:
            self.audit.close()
        return left

    def stats(self) -> dict[str, Any]:
        return {"store": self.store.stats().to_dict(), "records": [r.to_dict() for r in self.store.records],
                "backend": self.store.backend.name, "audit": self.audit.head if self.audit else None}

    def debug(self) -> dict[str, Any]:
        """Live blobs (id, state, bytes, chunks, readers, age) for operators and leak checks."""
        return {"backend": self.store.backend.name, "stats": self.store.stats().to_dict(),
                "blobs": [b.to_dict() for b in self.store.live()]}

    def _deleted(self, record: DeletionRecord) -> None:
        metrics.KV_BLOBS.labels(reason=record.reason).inc()
        metering.held(record, self.datacenter)
        metrics.STORE_BLOB_LIFETIME.labels(reason=record.reason).observe(
            max(0, record.deleted_ms - record.created_ms) / 1000)
        if self.audit:
            self.audit.deletion(record)

    def _accessed(self, record: AccessRecord) -> None:
        metrics.STORE_ACCESSES.labels(action=record.action, outcome=record.outcome).inc()
        if self.audit:
            self.audit.access(record)
        self._gauges()


def _backend(config: StoreConfig, instance_id: str) -> FrameBackend:
    """The configured backend, sealed (AES-256-GCM per blob) when a store master key is configured."""
    backend: FrameBackend = MemoryBackend()
    if config.store_backend == "redis":
        from prfaas.store.redis_backend import RedisBackend

        backend = RedisBackend(config.redis_url, f"prfaas:kv:{instance_id}:", config.redis_maxmemory_policy or None,
                               ca=config.redis_ca)
    master_key = load_master_key(config.store_key_file)
    return SealedBackend(backend, master_key) if master_key else backend


class IdentifiedTransferServer(TransferServer):
    """The data-plane server, with every store access recorded as made by the connection's peer: the client
    certificate's common name when TLS is mutual, and the peer's address."""

    async def _dispatch(self, request: Any, *args: Any) -> None:
        with accessing(who=peer_identity(args)):
            await super()._dispatch(request, *args)


def peer_identity(handles: tuple[Any, ...]) -> str:
    """``CN@address`` (or ``address``) of a connection, whichever object carries it (a ``Conn`` with ``sock`` and
    ``tls``, or an asyncio ``StreamWriter``)."""
    address, cert = "", None
    for handle in handles:
        if isinstance(getattr(handle, "sock", None), socket.socket):
            address = _address(handle.sock)
            tls = getattr(handle, "tls", None)
            cert = tls.getpeercert() if tls is not None else None
        elif hasattr(handle, "get_extra_info"):
            peer = handle.get_extra_info("peername")
            address, cert = (str(peer[0]) if peer else ""), handle.get_extra_info("peercert")
    cn = next((v for rdn in (cert or {}).get("subject", ()) for k, v in rdn if k == "commonName"), "")
    return f"{cn}@{address}" if cn else address or "peer"


def _address(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return ""
