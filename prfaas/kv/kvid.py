"""``kv_id``: ``<fingerprint short hash>-<creation unix ms>-<96 random bits, base32>`` (docs/contracts.md)."""

from __future__ import annotations

import base64
import re
import secrets
import time

from prfaas.errors import KVBadFormat

_KV_ID = re.compile(r"^[0-9a-f]{12}-[0-9]{13}-[a-z2-7]{20}$")


def new_kv_id(fingerprint_hash: str, now_ms: int | None = None) -> str:
    """A globally unique id that also says which model made it and when."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    rand = base64.b32encode(secrets.token_bytes(12)).decode().rstrip("=").lower()
    return f"{fingerprint_hash}-{ms:013d}-{rand}"


def check_kv_id(kv_id: str) -> str:
    """Validate an id read from the wire or a request; returns it unchanged."""
    if not isinstance(kv_id, str) or not _KV_ID.match(kv_id):
        raise KVBadFormat(f"malformed kv_id {str(kv_id)[:80]!r}")
    return kv_id


def created_ms(kv_id: str) -> int:
    """Creation time encoded in the id (unix milliseconds)."""
    return int(check_kv_id(kv_id).split("-")[1])
