"""The audit log of one instance's prefix cache (``PrefixAuditLog``), and what ``prfaas audit report --prefixes``
answers from it: where each tenant's cached prefixes live and when and why they were deleted.

Cached prefixes are tenant data like blobs, so they are recorded like blobs, in a hash-chained log
(``prfaas.audit.chain``) of their own: ``audit_log`` with ``{instance}`` → ``<instance>-prefix`` (else
``.<instance>-prefix`` appended), beside the store's log and the pool's usage log. Entries, all with ``instance``
and ``datacenter``:

- ``prefix_stored``: ``entry`` (a random id), ``tenant``, ``tokens``, ``bytes``, ``blocks``, ``created_ms``,
  ``at_ms``.
- ``prefix_deleted``: the same, with what was removed, ``reason`` (evicted, expired, tenant_deleted, shutdown),
  ``left_tokens`` (of that entry, still cached) and ``detail`` when recorded after a crash.

No token ids, text, block hashes or KV bytes enter it. A log whose previous session ended without recording its
entries' end (the process was killed: the cache died with it) gets a ``shutdown`` deletion for each when it is
opened again. Thread-safe (``ChainLog``); a failed write is counted, never raised.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any

from prfaas.audit.chain import ChainLog, read_entries
from prfaas.records import PREFIX_DELETED, PREFIX_STORED, SHUTDOWN, PrefixRecord

CRASHED = "the process that held it ended without recording this"


def prefix_log_path(audit_log: str, instance_id: str) -> str:
    """Where instance ``instance_id`` records its cached prefixes (see the module docstring); "" = nowhere."""
    if not audit_log:
        return ""
    name = f"{instance_id}-prefix"
    return audit_log.replace("{instance}", name) if "{instance}" in audit_log else f"{audit_log}.{name}"


class PrefixAuditLog:
    """Records of one instance's prefix cache at ``path``; ``instance`` and ``datacenter`` say where they live."""

    def __init__(self, path: str | os.PathLike[str], instance: str, datacenter: str) -> None:
        self.instance, self.datacenter = instance, datacenter
        left = _unended(path, instance) if os.path.exists(path) else {}
        self.chain = ChainLog(path)
        now = int(time.time() * 1000)
        for entry, row in left.items():
            self.record(PrefixRecord(PREFIX_DELETED, entry, row["tenant"], row["tokens"], row["bytes"], row["blocks"],
                                     row["created_ms"], now, SHUTDOWN), detail=CRASHED)

    def record(self, record: PrefixRecord, detail: str = "") -> None:
        fields = {"instance": self.instance, "datacenter": self.datacenter, **record.to_dict()}
        fields.pop("kind")
        if record.kind == PREFIX_STORED:  # a store has no reason and leaves the whole entry
            fields.pop("reason"), fields.pop("left_tokens")
        self.chain.append(record.kind, fields | ({"detail": detail} if detail else {}))

    def close(self) -> None:
        self.chain.close()


def _unended(path: str | os.PathLike[str], instance: str) -> dict[str, dict[str, Any]]:
    """Entries of ``instance`` the log shows stored and not wholly deleted: what is left of each."""
    left: dict[str, dict[str, Any]] = {}
    for _, e, _ in read_entries(path):
        if e is None or e.get("instance") != instance:
            continue
        entry = str(e.get("entry", ""))
        if e.get("kind") == PREFIX_STORED:
            left[entry] = {k: e.get(k, 0) for k in ("tokens", "bytes", "blocks", "created_ms")}
            left[entry]["tenant"] = str(e.get("tenant", ""))
        elif e.get("kind") == PREFIX_DELETED and entry in left:
            row = left[entry]
            for k in ("tokens", "bytes", "blocks"):
                row[k] = max(0, int(row[k]) - int(e.get(k, 0)))
            if not e.get("left_tokens"):
                del left[entry]
    return left


def prefix_report(entries: list[dict[str, Any]], tenant: str = "") -> dict[str, Any]:
    """Per tenant (only ``tenant`` when given, and on a prefill pool's instances ``<cluster>/<tenant>`` of every
    cluster): ``live``, where its cached prefixes are now (per instance: its datacenter, tokens, bytes, entries),
    and ``deletions`` in time order (when, where, why, tokens, bytes)."""
    tenants: dict[str, dict[str, Any]] = defaultdict(lambda: {"live": {}, "deletions": []})
    for e in sorted(entries, key=lambda e: int(e.get("at_ms", 0))):
        if e.get("kind") not in (PREFIX_STORED, PREFIX_DELETED) or not _is(str(e.get("tenant", "")), tenant):
            continue
        row = tenants[str(e.get("tenant", ""))]
        where = row["live"].setdefault(str(e.get("instance", "")), {
            "datacenter": str(e.get("datacenter", "")), "tokens": 0, "bytes": 0, "entries": set()})
        sign = 1 if e.get("kind") == PREFIX_STORED else -1
        where["tokens"] += sign * int(e.get("tokens", 0))
        where["bytes"] += sign * int(e.get("bytes", 0))
        if sign > 0:
            where["entries"].add(e.get("entry"))
        else:
            if not e.get("left_tokens"):
                where["entries"].discard(e.get("entry"))
            row["deletions"].append({k: e.get(k) for k in (
                "at_ms", "instance", "datacenter", "reason", "tokens", "bytes", "created_ms", "detail") if k in e})
    for row in tenants.values():
        row["live"] = {i: {**w, "entries": len(w["entries"])} for i, w in row["live"].items() if w["entries"]}
    return {"tenants": dict(sorted(tenants.items()))}


def _is(salted: str, tenant: str) -> bool:
    """Whether a record's tenant is ``tenant`` ("" = any): itself, or as a prefill pool salts it."""
    return not tenant or salted == tenant or salted.endswith(f"/{tenant}")
