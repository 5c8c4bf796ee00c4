"""KV blob stores: TTL + LRU under a byte budget, release by the consumer, one deletion record per blob."""

from prfaas.store.memory import BlobStore
from prfaas.store.records import (
    ABORTED,
    EVICTED,
    EXPIRED,
    READY,
    RELEASED,
    SHUTDOWN,
    WRITING,
    DeletionRecord,
    StoreStats,
)

__all__ = [
    "ABORTED", "EVICTED", "EXPIRED", "READY", "RELEASED", "SHUTDOWN", "WRITING", "BlobStore", "DeletionRecord",
    "StoreStats",
]
