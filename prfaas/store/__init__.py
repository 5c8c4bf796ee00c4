"""KV blob stores: TTL + LRU under a byte budget, release by the consumer, one deletion record per blob, one access
record per create/finish/read/release/abort. Backends: memory (default) and Redis (``open_store``)."""

from prfaas.records import (
    ABORTED,
    EVICTED,
    EXPIRED,
    READY,
    RELEASED,
    SHUTDOWN,
    WRITING,
    AccessRecord,
    DeletionRecord,
    LiveBlob,
    StoreStats,
)
from prfaas.store.access import accessing
from prfaas.store.backend import FrameBackend, MemoryBackend
from prfaas.store.core import BlobStore

__all__ = [
    "ABORTED", "EVICTED", "EXPIRED", "READY", "RELEASED", "SHUTDOWN", "WRITING", "AccessRecord", "BlobStore",
    "DeletionRecord", "FrameBackend", "LiveBlob", "MemoryBackend", "StoreStats", "accessing",
]
