"""``verify``: walk a chained audit log, check every link, and sum up what it records.

A log verifies when every line parses, ``seq`` counts up from 0, each ``prev`` is the previous ``hash`` and each
``hash`` is the entry's own. The summary also says which blobs were created and never ended (live when the log
stops, or lost), and whether the last store session closed cleanly.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prfaas.audit.chain import GENESIS, entry_hash, read_entries


@dataclass
class Verdict:
    path: str
    entries: int = 0
    ok: bool = True
    error: str = ""  # the first broken link, e.g. "line 12: hash does not match the entry"
    head: str = GENESIS
    kinds: Counter[str] = field(default_factory=Counter)
    ended: Counter[str] = field(default_factory=Counter)  # deletions by reason
    created: int = 0
    open_blobs: list[str] = field(default_factory=list)  # created, no deletion entry
    sessions: int = 0
    clean_close: bool = False
    first_ms: int | None = None
    last_ms: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "entries": self.entries, "error": self.error, "head": self.head,
                "kinds": dict(self.kinds), "created": self.created, "ended": dict(self.ended),
                "open_blobs": self.open_blobs, "sessions": self.sessions, "clean_close": self.clean_close,
                "first_ms": self.first_ms, "last_ms": self.last_ms}


def verify(path: str | os.PathLike[str]) -> Verdict:
    """Check the chain of ``path``; the first broken link is reported and the summary still covers every line."""
    verdict, prev, live = Verdict(str(path)), GENESIS, dict[str, None]()
    for number, entry, _ in read_entries(path):
        verdict.entries += 1
        problem = _link_problem(entry, verdict.entries - 1, prev)
        if problem and verdict.ok:
            verdict.ok, verdict.error = False, f"line {number}: {problem}"
        if entry is None:
            continue
        prev = str(entry.get("hash", ""))
        _count(verdict, entry, live)
    verdict.head = prev
    verdict.open_blobs = list(live)
    return verdict


def _link_problem(entry: dict[str, Any] | None, seq: int, prev: str) -> str:
    if entry is None:
        return "not a JSON object"
    if entry.get("seq") != seq:
        return f"seq is {entry.get('seq')!r}, expected {seq} (an entry was removed, inserted or moved)"
    if entry.get("prev") != prev:
        return "prev does not match the previous entry's hash"
    if entry.get("hash") != entry_hash(entry):
        return "hash does not match the entry (it was changed)"
    return ""


def _count(verdict: Verdict, entry: dict[str, Any], live: dict[str, None]) -> None:
    kind = str(entry.get("kind", ""))
    verdict.kinds[kind] += 1
    at = entry.get("at_ms") or entry.get("deleted_ms")
    if isinstance(at, int):
        verdict.first_ms = at if verdict.first_ms is None else min(verdict.first_ms, at)
        verdict.last_ms = at if verdict.last_ms is None else max(verdict.last_ms, at)
    if kind == "open":
        verdict.sessions += 1
    verdict.clean_close = kind == "close"
    if kind == "access" and entry.get("action") == "create" and entry.get("outcome") == "ok":
        verdict.created += 1
        live[str(entry.get("kv_id"))] = None
    elif kind == "deletion":
        verdict.ended[str(entry.get("reason"))] += 1
        live.pop(str(entry.get("kv_id")), None)
