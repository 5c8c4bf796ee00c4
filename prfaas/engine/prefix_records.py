"""``PrefixLifecycle``: what makes a prefix cache's blocks tenant data like blobs: a TTL, the tenant's residency,
and a record of every store and deletion (``prfaas.records.PrefixRecord``, written to the instance's prefix audit
log, ``prfaas.audit.prefix``).

An *entry* is the blocks one store added (one prompt's new prefix, in ``PrefixCache.store``): it is created with a
random id, the tenant whose salt named its blocks and its creation time. Each block points at its entry; the TTL
counts from the entry's creation (a hit does not extend it, as a read does not extend a blob's), and its blocks
are recorded as deleted, one record per entry and reason, when evicted, expired, dropped with their tenant or lost
at shutdown. A tenant whose residency policy does not allow this instance's datacenter gets nothing stored here.

The cache calls it from its engine thread; ``close`` (shutdown) may come from another, so the live entries and the
sink are behind one lock. Records never carry token ids or block hashes.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prfaas.audit.prefix import PrefixAuditLog, prefix_log_path
from prfaas.config import Config
from prfaas.records import PREFIX_DELETED, PREFIX_STORED, SHUTDOWN, PrefixRecord
from prfaas.tenancy import DEFAULT_TENANT, Tenants

Sink = Callable[[PrefixRecord], None]


@dataclass
class Entry:
    """The blocks one store added: ``blocks``, ``tokens`` and ``bytes`` are what of them is still held."""

    id: str
    tenant: str
    created_ms: int
    born_s: float  # on the lifecycle's clock, for the TTL
    blocks: int = 0
    tokens: int = 0
    bytes: int = 0


class PrefixLifecycle:
    """TTL (``ttl_s``; 0 = none), residency (``allows``: tenant → may its prefixes be cached here) and records
    (``sink``; None = not recorded) of one prefix cache. ``clock``: seconds."""

    def __init__(self, ttl_s: float = 0.0, allows: Callable[[str], bool] = lambda tenant: True,
                 sink: Sink | None = None, close_sink: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.ttl_s, self.allows, self.clock = ttl_s, allows, clock
        self._sink, self._close_sink = sink, close_sink
        self._live: dict[str, Entry] = {}
        # (entry id, reason) → the entry and [blocks, tokens, bytes] dropped and not yet recorded
        self._gone: dict[tuple[str, str], tuple[Entry, list[int]]] = {}
        self._lock = threading.Lock()

    @classmethod
    def configured(cls, config: Config, instance_id: str,
                   clock: Callable[[], float] = time.time) -> PrefixLifecycle:
        """The lifecycle of instance ``instance_id``: ``prefix_cache_ttl_s``, the ``tenants``' residency against
        its ``datacenter``, and its prefix audit log when ``audit_log`` is set."""
        datacenter, tenants = config.common.datacenter, Tenants.from_config(config.tenants)
        path = prefix_log_path(config.store.audit_log, instance_id)
        audit = PrefixAuditLog(path, instance_id, datacenter) if path else None
        def allows(tenant: str) -> bool:
            return tenants.policy(policy_name(tenant)).allows(datacenter)

        return cls(config.prefill.prefix_cache_ttl_s, allows, audit.record if audit else None,
                   audit.close if audit else None, clock)

    def entry(self, tenant: str) -> Entry:
        """A new entry for the blocks a store of ``tenant``'s prefix is about to add."""
        return Entry(f"px-{secrets.token_hex(8)}", tenant, int(time.time() * 1000), self.clock())

    def expired(self, entry: Entry | None) -> bool:
        return entry is not None and self.ttl_s > 0 and self.clock() - entry.born_s >= self.ttl_s

    def stored(self, entry: Entry, blocks: int, tokens: int, nbytes: int) -> None:
        """Record what a store added: ``blocks`` new blocks of ``tokens``, and ``nbytes`` (theirs, and what blocks
        held already gained); nothing when it added no block."""
        if not blocks:
            return
        with self._lock:
            entry.blocks, entry.tokens, entry.bytes = entry.blocks + blocks, entry.tokens + tokens, entry.bytes + nbytes
            self._live[entry.id] = entry
            self._emit(PrefixRecord(PREFIX_STORED, entry.id, entry.tenant, tokens, nbytes, blocks, entry.created_ms,
                                    _now_ms()))

    def dropped(self, entry: Entry | None, tokens: int, nbytes: int, reason: str) -> None:
        """One block of ``entry`` left the cache; recorded with the others of its entry and reason at ``flush``."""
        if entry is None:
            return
        with self._lock:
            _, gone = self._gone.setdefault((entry.id, reason), (entry, [0, 0, 0]))
            gone[0], gone[1], gone[2] = gone[0] + 1, gone[1] + tokens, gone[2] + nbytes
            entry.blocks, entry.tokens, entry.bytes = entry.blocks - 1, entry.tokens - tokens, entry.bytes - nbytes

    def flush(self) -> None:
        """Record the deletions ``dropped`` gathered: one record per entry and reason."""
        with self._lock:
            gone, self._gone = self._gone, {}
            for (_, reason), (entry, (blocks, tokens, nbytes)) in gone.items():
                if entry.blocks <= 0:
                    self._live.pop(entry.id, None)
                self._deleted(entry, reason, blocks, tokens, nbytes)

    def close(self) -> None:
        """Shutdown: every entry still held is recorded as deleted (the cache dies with the process), then the
        sink is closed; later records are dropped. Idempotent; any thread."""
        self.flush()
        with self._lock:
            for entry in self._live.values():
                left, entry.blocks, entry.tokens, entry.bytes = (entry.blocks, entry.tokens, entry.bytes), 0, 0, 0
                self._deleted(entry, SHUTDOWN, *left)
            self._live.clear()
            if self._close_sink:
                self._close_sink()
            self._sink = self._close_sink = None

    def _deleted(self, entry: Entry, reason: str, blocks: int, tokens: int, nbytes: int) -> None:
        self._emit(PrefixRecord(PREFIX_DELETED, entry.id, entry.tenant, tokens, nbytes, blocks, entry.created_ms,
                                _now_ms(), reason, max(0, entry.tokens)))

    def _emit(self, record: PrefixRecord) -> None:
        if self._sink is not None:
            self._sink(record)


def policy_name(tenant: str) -> str:
    """The tenant policy that governs a salt's tenant: a prefill pool salts ``<cluster>/<tenant>``
    (``prfaas.kv.prefix.pool_tenant``), whose tenant part names the policy; "" is the default tenant."""
    return tenant.rpartition("/")[2] or DEFAULT_TENANT


def _now_ms() -> int:
    return int(time.time() * 1000)
