"""Payload memory for pulls: an ``ArenaPool`` hands each ``BlobReader`` one contiguous, reused, page-touched region
that chunks are received into directly (chunk ``i`` at payload offset ``i × chunk_size``) and that the layers'
tensors are views of: the only copy of a pulled byte is the kernel's, into its final place.

Why reuse: fresh memory costs a page fault per page on first touch (on a busy VM that ran at 0.3–1 GB/s, slower
than the network); memory touched before is written at memcpy speed. An arena is an anonymous private mapping of
the reader's ``max_bytes`` (``MAP_NORESERVE``: only the pages a blob really used are ever committed), kept by the
pool after its blob is gone and handed to the next reader. It is not advised into transparent huge pages: where the
kernel compacts memory for such advice on the fault itself (``defrag`` "madvise", a common default), touching a
fresh GiB took 1.85 s on a 2-core VM whose memory had been used before, against 0.42–0.47 s in 4 KiB pages.

Reuse rule: an arena goes to a new reader only once nothing else refers to it. The pool keeps the arena array;
every tensor of a pulled ``KVState`` is a numpy view whose ``base`` is that array, so once the caller drops the
state (decode drops it when the KV is restored into its model cache, which copies) and its reader, the array's
reference count falls back to the pool's own and the arena is free again. No release call, and no way to hand out
memory that someone still reads.

Ownership: one pool per role, in its ``prfaas.transfer.context.TransferContext``. Bound: at most ``max_blobs``
arenas (``max_inflight_kv``) per pool; when all are in use a reader gets a fresh,
untracked mapping, unmapped as usual when dropped. Idle memory: besides the arenas in use the pool keeps at most
``SPARE`` free ones (the rest are unmapped at the next ``take``), so a burst of pulls does not pin its peak memory
while sequential pulls still always find a touched arena. Thread-safe.
"""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux; Python 3.11 does not export it
SPARE = 1  # free arenas kept beyond those in use


def new_arena(capacity: int) -> np.ndarray:
    """A zero-filled uint8 array of at least ``capacity`` bytes (whole pages) in its own lazily committed mapping.
    Not a slice: views of it must have it as their ``base`` for the pool's reuse rule."""
    pages = max(1, -(-capacity // mmap.PAGESIZE))
    region = mmap.mmap(-1, pages * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    return np.frombuffer(region, dtype=np.uint8)


class ArenaPool:
    """Reused payload arenas (module docstring)."""

    def __init__(self, max_blobs: int) -> None:
        self.max_blobs = max(1, max_blobs)
        self._lock = threading.Lock()
        self._arenas: list[np.ndarray] = []
        self.reused = 0  # arenas handed out again (tests)

    def take(self, capacity: int) -> np.ndarray:
        """An arena of at least ``capacity`` bytes that nobody else holds."""
        with self._lock:
            chosen = self._choose(capacity)
            self._trim(chosen)
        return chosen if chosen is not None else new_arena(capacity)

    def _choose(self, capacity: int) -> np.ndarray | None:
        for arena in self._arenas:
            # referents: the list, ``arena`` and getrefcount's argument; more is a reader or a tensor
            if len(arena) >= capacity and sys.getrefcount(arena) <= 3:
                self.reused += 1
                return arena
        if len(self._arenas) < self.max_blobs:
            self._arenas.append(new_arena(capacity))
            return self._arenas[-1]
        for i, arena in enumerate(self._arenas):
            if sys.getrefcount(arena) <= 3:  # free but too small: replace it by a larger one
                self._arenas[i] = new_arena(capacity)
                return self._arenas[i]
        return None

    def _trim(self, chosen: np.ndarray | None) -> None:
        """Unmap free arenas beyond ``SPARE`` (besides ``chosen``)."""
        keep, spare = [], 0
        for arena in self._arenas:
            if arena is not chosen and sys.getrefcount(arena) <= 3:
                if spare >= SPARE:
                    continue
                spare += 1
            keep.append(arena)
        self._arenas = keep

    @property
    def arenas(self) -> int:
        return len(self._arenas)

    def in_use(self) -> int:
        """Arenas someone still holds (a reader or a tensor of a pulled state)."""
        with self._lock:
            return sum(1 for arena in self._arenas if sys.getrefcount(arena) > 3)

    def clear(self) -> None:
        """Forget every arena (memory in use stays valid: its users hold it)."""
        with self._lock:
            self._arenas.clear()
