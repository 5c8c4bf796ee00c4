"""An append-only, hash-chained log of JSON lines.

Each entry is one JSON object on one line with ``seq`` (0, 1, …), ``prev`` (the previous entry's ``hash``; 64
zeros for the first) and ``hash`` = SHA-256 of the entry's canonical JSON without ``hash`` (sorted keys, no spaces,
UTF-8). Changing, removing, inserting or reordering any entry breaks every later link, which ``verify`` reports;
cutting entries off the end is detected only against a head (``seq``, ``hash``) published elsewhere (``/stats``
shows it, and each store writes a ``close`` entry on a clean shutdown).

Reopening a file continues its chain after the last entry that parses. Writes are serialised by one lock and
flushed to the OS per entry; ``close`` fsyncs. Failure: an unwritable file raises ``OSError`` at open; a write that
fails later is logged and counted (``failures``), never raised into the data plane.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
GENESIS = "0" * 64


def canonical(entry: dict[str, Any]) -> bytes:
    body = {k: v for k, v in entry.items() if k != "hash"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def entry_hash(entry: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(entry)).hexdigest()


def read_entries(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
    """``(line number, entry or None if it does not parse, raw line)`` for every non-empty line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                yield number, None, line
                continue
            yield number, entry if isinstance(entry, dict) else None, line


class ChainLog:
    """Appends chained entries to ``path`` (created with its folder if missing)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq, self.head = 0, GENESIS
        if self.path.exists():
            for _, entry, _ in read_entries(self.path):
                if entry is not None and isinstance(entry.get("hash"), str) and isinstance(entry.get("seq"), int):
                    self.seq, self.head = entry["seq"] + 1, entry["hash"]
        self.failures = 0
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def append(self, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
        """Chain and write one entry; returns it (with ``seq``, ``prev``, ``hash``)."""
        with self._lock:
            entry = {"seq": self.seq, "kind": kind, **fields, "prev": self.head}
            entry["hash"] = entry_hash(entry)
            try:
                self._file.write(json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                                 + "\n")
                self._file.flush()
            except (OSError, ValueError):
                self.failures += 1
                log.exception("audit log %s: write failed (entry %d)", self.path, self.seq)
                return entry
            self.seq, self.head = self.seq + 1, entry["hash"]
            return entry

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
