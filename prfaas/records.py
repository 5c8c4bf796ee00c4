"""What a store reports: one ``DeletionRecord`` per blob that ends, one ``AccessRecord`` per create, read, release
or abort, and ``StoreStats`` / ``LiveBlob`` for health and leak checks.

All are frozen dataclasses of plain fields, so they travel unchanged as data-plane messages
(``prfaas.transfer.protocol``) and serialise to JSON for the audit log (``prfaas.audit``). None of them ever
holds prompt text: a blob is known by its ``kv_id``, its sizes and its checksum.

Ground floor: the store writes these records and the data plane, the audit log, metering and the refusal log read
them, so this module imports nothing of prfaas but its errors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from prfaas.errors import KVExpired, KVNotFound, KVTruncated, KVUnavailable, PrfaasError

# Blob states while it lives, and the reasons it can end.
WRITING, READY = "writing", "ready"
RELEASED, EXPIRED, EVICTED, ABORTED, SHUTDOWN = "released", "expired", "evicted", "aborted", "shutdown"
REASONS = (RELEASED, EXPIRED, EVICTED, ABORTED, SHUTDOWN)
# What an access record can say was done.
CREATE, FINISH, READ, RELEASE, ABORT = "create", "finish", "read", "release", "abort"
OK = "ok"


@dataclass(frozen=True)
class DeletionRecord:
    """The end of one blob: why, how big, the whole-payload xxHash64 (``None`` if it never finished), when it
    was created and deleted (unix milliseconds), its tenant, and whether its data key was destroyed with it
    (encryption at rest: ``prfaas.store.sealed``)."""

    kv_id: str
    reason: str
    bytes: int
    chunks: int
    payload_xxh64: int | None
    created_ms: int
    deleted_ms: int
    tenant: str = ""
    key_destroyed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AccessRecord:
    """One access to one blob: ``who`` (the authenticated peer, or this store's owner for local calls), the
    ``action``, ``bytes`` involved (written so far, served, or released), ``purpose`` (the request id when the
    caller gave one), ``outcome`` (``ok`` or the error code returned), when (unix milliseconds), and the tenant
    of the blob (``""`` when none or unknown)."""

    action: str
    kv_id: str
    who: str
    purpose: str
    bytes: int
    outcome: str
    at_ms: int
    tenant: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StoreStats:
    """A snapshot: live blobs and bytes (frames as stored), the budget, live blobs by state, blobs being read
    right now, and how many blobs have ended since the store started."""

    blobs: int
    bytes: int
    budget_bytes: int
    writing: int
    ready: int
    readers: int
    deleted: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LiveBlob:
    """One live blob as ``/debug/store`` shows it (operators' view; never a metric label)."""

    kv_id: str
    state: str
    bytes: int
    chunks: int
    readers: int
    age_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gone_error(kv_id: str, reason: str | None) -> PrfaasError:
    """The error a reader gets for a blob that has ended (``reason``) or that this store never knew (``None``)."""
    if reason == EXPIRED:
        return KVExpired(f"KV blob {kv_id} expired (TTL passed)")
    if reason == ABORTED:
        return KVTruncated(f"KV blob {kv_id} was aborted by its writer")
    if reason == SHUTDOWN:
        return KVUnavailable(f"KV store shut down; blob {kv_id} is gone")
    what = {RELEASED: "was released", EVICTED: "was evicted"}.get(reason or "", "is unknown to this store")
    return KVNotFound(f"KV blob {kv_id} {what}")


# A tenant's cached prompt prefix (``prfaas.engine.prefix_records``): stored, then deleted for one of these reasons.
PREFIX_STORED, PREFIX_DELETED = "prefix_stored", "prefix_deleted"
TENANT_DELETED = "tenant_deleted"
PREFIX_REASONS = (EVICTED, EXPIRED, TENANT_DELETED, SHUTDOWN)


@dataclass(frozen=True)
class PrefixRecord:
    """One event of one *entry*, the blocks a single store of a prompt's prefix added to an instance's prefix
    cache: ``kind`` ``prefix_stored`` (``tokens``, ``bytes`` and ``blocks`` added) or ``prefix_deleted`` (those
    removed, and why: ``reason``; ``left_tokens`` of the entry still cached after it). ``entry`` is a random id,
    ``tenant`` the one whose salt named the blocks; times are unix milliseconds. Never token ids, text, block
    hashes or KV bytes: the audit log says where a tenant's prefixes are and when they went, not what they were."""

    kind: str
    entry: str
    tenant: str
    tokens: int
    bytes: int
    blocks: int
    created_ms: int
    at_ms: int
    reason: str = ""
    left_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
