"""Answers from audit logs: the story of one blob (was it deleted, when, why, who touched it) and a summary of
a whole log (what ended how, who accessed what, how long blobs lived). Works on several files at once (a relay's
and every prefill's), reading each entry as written; ``verify`` is what vouches for them."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from prfaas.audit.chain import read_entries


def entries(paths: list[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        for _, entry, _ in read_entries(path):
            if entry is not None:
                out.append({**entry, "file": str(path)})
    return out


def blob_story(all_entries: list[dict[str, Any]], kv_id: str) -> dict[str, Any]:
    """Everything recorded about ``kv_id``: ``deleted`` (bool), ``deletion`` (when, why, sizes, checksum),
    ``created_ms``, ``accesses`` in order."""
    mine = [e for e in all_entries if e.get("kv_id") == kv_id]
    deletions = [e for e in mine if e.get("kind") == "deletion"]
    accesses = [_access_view(e) for e in mine if e.get("kind") == "access"]
    created = next((a["at_ms"] for a in accesses if a["action"] == "create" and a["outcome"] == "ok"), None)
    last = deletions[-1] if deletions else None
    deletion = None if last is None else {k: last.get(k) for k in (
        "reason", "deleted_ms", "created_ms", "bytes", "chunks", "checksum", "store", "detail") if k in last}
    return {"kv_id": kv_id, "known": bool(mine), "deleted": last is not None, "deletion": deletion,
            "created_ms": created, "accesses": accesses}


def summary(all_entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over every entry: blobs created and ended by reason, blobs with no end, accesses by action, by
    who and by outcome, and blob lifetimes (created → deleted) in milliseconds."""
    created, ended, lifetimes = set(), Counter[str](), []
    actions, who, outcomes = Counter[str](), Counter[str](), Counter[str]()
    for e in all_entries:
        if e.get("kind") == "access":
            actions[str(e.get("action"))] += 1
            who[str(e.get("who"))] += 1
            outcomes[str(e.get("outcome"))] += 1
            if e.get("action") == "create" and e.get("outcome") == "ok":
                created.add(str(e.get("kv_id")))
        elif e.get("kind") == "deletion":
            ended[str(e.get("reason"))] += 1
            created.discard(str(e.get("kv_id")))
            lifetimes.append(int(e.get("deleted_ms", 0)) - int(e.get("created_ms", 0)))
    return {"blobs_ended": sum(ended.values()), "ended_by_reason": dict(ended), "never_ended": sorted(created),
            "accesses_by_action": dict(actions), "accesses_by_who": dict(who),
            "accesses_by_outcome": dict(outcomes), "lifetime_ms": _quantiles(lifetimes)}


def _access_view(e: dict[str, Any]) -> dict[str, Any]:
    return {k: e.get(k) for k in ("action", "who", "purpose", "bytes", "outcome", "at_ms", "store")}


def _quantiles(values: list[int]) -> dict[str, int] | None:
    if not values:
        return None
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1]}
