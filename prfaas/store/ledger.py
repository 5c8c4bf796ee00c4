"""A store's bookkeeping of ends and accesses: builds ``DeletionRecord`` / ``AccessRecord``, keeps the recent
deletion records, and hands every record to the callbacks (the audit log, metrics).

Callbacks run in the caller's thread, deletion callbacks under the store's lock: keep them short, thread-safe,
and never call back into the store. A callback that raises is logged and ignored: the store's state is already
decided, and a broken audit sink must not wedge the data plane (the audit log reports its own failures).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prfaas.records import OK, AccessRecord, DeletionRecord
from prfaas.store import access
from prfaas.store.blob import Blob

log = logging.getLogger(__name__)
MAX_RECORDS = 100_000  # kept in ``records``; the durable copy is whatever ``on_delete`` writes

R = TypeVar("R")
OnDelete = Callable[[DeletionRecord], None]
OnAccess = Callable[[AccessRecord], None]


@dataclass
class Tally:
    """What one access amounted to, filled in while it runs."""

    bytes: int
    outcome: str
    tenant: str = ""


class Ledger:
    def __init__(self, owner: str, on_delete: OnDelete | None, on_access: OnAccess | None,
                 wall: Callable[[], float] = time.time) -> None:
        self.owner, self.on_delete, self.on_access, self._wall = owner, on_delete, on_access, wall
        self.records: list[DeletionRecord] = []
        self.deleted = 0

    def now_ms(self) -> int:
        return int(self._wall() * 1000)

    def ended(self, blob: Blob, reason: str, key_destroyed: bool = False) -> DeletionRecord:
        record = DeletionRecord(blob.kv_id, reason, blob.nbytes, blob.chunks, blob.payload_xxh64,
                                blob.created_ms, self.now_ms(), blob.tenant, key_destroyed)
        self.deleted += 1
        self.records.append(record)
        if len(self.records) > MAX_RECORDS:
            del self.records[:MAX_RECORDS // 2]
        _call(self.on_delete, record)
        return record

    def access(self, action: str, kv_id: str, nbytes: int, outcome: str = OK, tenant: str = "") -> None:
        if self.on_access is None:
            return
        who = access.current()
        _call(self.on_access, AccessRecord(action, kv_id, who.who or self.owner, who.purpose, nbytes, outcome,
                                           self.now_ms(), tenant or who.tenant))


def _call(callback: Callable[[R], None] | None, record: R) -> None:
    if callback is None:
        return
    try:
        callback(record)
    except Exception:
        log.exception("store record callback failed for %r", record)
