"""Where a store keeps blob frames. ``BlobStore`` owns the rules (states, TTL, budget, LRU, readers, records); a
``FrameBackend`` only holds bytes: ``MemoryBackend`` in this process, ``RedisBackend`` on a Redis server.

Slots: ``HEADER``, ``TRAILER``, and chunk ``i`` (0, 1, …). Every method is called under the store's lock. A
backend never keeps a blob the store has dropped; it may lose one on its own (Redis TTL or memory policy):
``put`` then returns ``False`` and ``get`` returns ``None``, and the store ends the blob (``expired`` if its TTL
passed, else ``evicted``), so a reader gets an error, never partial data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

HEADER, TRAILER = -1, -2


@dataclass(frozen=True)
class BlobMeta:
    """What a backend keeps beside the frames, so a restarted store can adopt the blobs it finds."""

    kv_id: str
    chunk_size: int
    created_ms: int
    chunks: int = 0
    payload: int = 0
    nbytes: int = 0
    payload_xxh64: int | None = None
    ready: bool = False


class FrameBackend(Protocol):
    name: str

    def start(self, meta: BlobMeta, header: bytes, ttl_s: float) -> None:
        """Hold a new blob's header frame; the backend's own copy expires ``ttl_s`` (plus a grace) from now."""

    def put(self, meta: BlobMeta, slot: int, frame: bytes) -> bool:
        """Store one more frame and the updated ``meta``; ``False`` if the backend no longer has the blob."""

    def get(self, kv_id: str, slot: int) -> bytes | None:
        """One frame, or ``None`` if the backend no longer has the blob (or that slot)."""

    def drop(self, kv_id: str) -> None:
        """Forget the blob (no error if it is already gone)."""

    def leftovers(self) -> list[BlobMeta]:
        """Blobs a previous store left in this backend (a restart); the new store adopts or ends them."""

    def close(self) -> None:
        """Release connections; the frames stay wherever the backend keeps them."""


class MemoryBackend:
    """Frames in this process's memory; nothing survives the process."""

    name = "memory"
    holds_frames = True  # keeps the very objects it is given (a wrapper must not reuse them until ``drop``)

    def __init__(self) -> None:
        self._blobs: dict[str, dict[int, bytes]] = {}

    def start(self, meta: BlobMeta, header: bytes, ttl_s: float) -> None:
        self._blobs[meta.kv_id] = {HEADER: header}

    def put(self, meta: BlobMeta, slot: int, frame: bytes) -> bool:
        frames = self._blobs.get(meta.kv_id)
        if frames is None:
            return False
        frames[slot] = frame
        return True

    def get(self, kv_id: str, slot: int) -> bytes | None:
        return self._blobs.get(kv_id, {}).get(slot)

    def drop(self, kv_id: str) -> None:
        self._blobs.pop(kv_id, None)

    def leftovers(self) -> list[BlobMeta]:
        return []

    def close(self) -> None:
        self._blobs.clear()
