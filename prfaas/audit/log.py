"""``AuditLog``: what a store records, as chained entries (``prfaas.audit.chain``).

Entries (besides ``seq``, ``prev``, ``hash``), all with ``store`` (the instance id):

- ``open``: a store session starts (``backend``, ``ttl_s``, ``budget_bytes``, ``at_ms``).
- ``access``: ``action`` (create, finish, read, release, abort), ``kv_id``, ``who`` (the authenticated peer or
  the instance), ``purpose`` (request id when known), ``bytes``, ``outcome`` (``ok`` or an error code), ``at_ms``,
  ``tenant`` (the blob's; ``""`` when none).
- ``deletion``: ``kv_id``, ``reason`` (released, expired, evicted, aborted, shutdown), ``bytes``, ``chunks``,
  ``checksum`` (``xxh64:<hex>`` of the payload, null if it never finished), ``created_ms``, ``deleted_ms``,
  ``tenant``, ``key_destroyed`` (its data key was destroyed with it: encryption at rest), and ``detail`` when the
  store that held the blob did not record its end itself.
- ``close``: a clean shutdown (``at_ms``, ``created``, ``deleted`` in this session).

No prompt text, token ids or KV bytes ever enter the log: a blob is its id, sizes and checksum.

A session that starts on a log whose previous session never closed (the process was killed) records a deletion
for every blob the log shows as created and not ended that the new store does not hold (``settle``): the blob
died with the process (memory) or Redis expired it meanwhile. Thread-safe; callbacks never raise.
"""

from __future__ import annotations

import os
import time
from typing import Any

from prfaas.audit.chain import ChainLog, read_entries
from prfaas.records import EXPIRED, OK, SHUTDOWN, AccessRecord, DeletionRecord


class AuditLog:
    def __init__(self, path: str | os.PathLike[str], store: str) -> None:
        self.store = store
        self._known: dict[str, dict[str, int]] = _unended(path) if os.path.exists(path) else {}
        self.chain = ChainLog(path)
        self.created = self.deleted = 0

    @property
    def head(self) -> dict[str, Any]:
        return {"path": str(self.chain.path), "seq": self.chain.seq, "hash": self.chain.head,
                "failures": self.chain.failures}

    def opened(self, **facts: Any) -> None:
        self.chain.append("open", {"store": self.store, "at_ms": _now_ms(), **facts})

    def access(self, record: AccessRecord) -> None:
        if record.action == "create" and record.outcome == OK:
            self.created += 1
            self._known[record.kv_id] = {"created_ms": record.at_ms, "bytes": record.bytes}
        elif record.kv_id in self._known and record.outcome == OK:
            self._known[record.kv_id]["bytes"] = max(record.bytes, self._known[record.kv_id]["bytes"])
        self.chain.append("access", {"store": self.store, **record.to_dict()})

    def deletion(self, record: DeletionRecord, detail: str = "") -> None:
        self._known.pop(record.kv_id, None)
        self.deleted += 1
        fields = record.to_dict()
        checksum = fields.pop("payload_xxh64")
        fields["checksum"] = None if checksum is None else f"xxh64:{checksum:016x}"
        self.chain.append("deletion", {"store": self.store, **fields, **({"detail": detail} if detail else {})})

    def settle(self, live: set[str], ttl_s: float) -> int:
        """Record the end of every blob this log knows as created, not ended, and not in ``live``; returns how
        many. Their end is ``expired`` if the TTL has passed since creation, else ``shutdown``."""
        now = _now_ms()
        orphans = [(k, v) for k, v in self._known.items() if k not in live]
        for kv_id, known in orphans:
            reason = EXPIRED if now - known["created_ms"] >= ttl_s * 1000 else SHUTDOWN
            self.deletion(DeletionRecord(kv_id, reason, known["bytes"], 0, None, known["created_ms"], now),
                          detail="the store process that held it ended without recording this")
        return len(orphans)

    def close(self) -> None:
        self.chain.append("close", {"store": self.store, "at_ms": _now_ms(), "created": self.created,
                                    "deleted": self.deleted})
        self.chain.close()


def _unended(path: str | os.PathLike[str]) -> dict[str, dict[str, int]]:
    known: dict[str, dict[str, int]] = {}
    for _, entry, _ in read_entries(path):
        if entry is None:
            continue
        kv_id = str(entry.get("kv_id", ""))
        if entry.get("kind") == "access" and entry.get("outcome") == OK:
            if entry.get("action") == "create":
                known[kv_id] = {"created_ms": int(entry.get("at_ms", 0)), "bytes": int(entry.get("bytes", 0))}
            elif kv_id in known:
                known[kv_id]["bytes"] = max(known[kv_id]["bytes"], int(entry.get("bytes", 0)))
        elif entry.get("kind") == "deletion":
            known.pop(kv_id, None)
    return known


def _now_ms() -> int:
    return int(time.time() * 1000)
