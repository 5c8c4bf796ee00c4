"""Reused memory for the chunk frames a ``BlobWriter`` writes: the sending side's counterpart of the receiving side's
arenas (``prfaas.transfer.buffers``).

Why: a frame written into fresh memory pays a page fault per 4 KiB page on first touch, which made encoding a
blob more than twice as slow as writing it into memory touched before (figures: docs/transport.md). The encoding
runs on the prefill instance's engine thread between two layers, so that difference is the prefill's.

Reuse rule (the arenas' rule): a buffer goes to a new frame only once nothing else refers to it. The pool keeps
every buffer it made; a frame handed out is that ``bytearray`` itself, and a push's queue, its socket write or
anything else that still holds it (or a ``memoryview`` of it) keeps its reference count up, so it is not written
again until all of them have let go. No release call, and no way to overwrite a frame someone still sends.

Bound: the buffers the pool made add up to at most ``max_bytes``; past that a frame is fresh memory, as without a
pool. The pool keeps them while idle (at most ``max_bytes``). Only full chunk frames (one size per pool at a time)
come from it. Thread-safe.
"""

from __future__ import annotations

import sys
import threading

FRAME_POOL_BYTES = 96 << 20  # a push's queue (64 MiB), the frame it is sending and a layer's frames not yet queued


class FramePool:
    """Reused chunk-frame buffers (module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._buffers: list[bytearray] = []
        self.reused = 0  # buffers handed out again (tests)

    def take(self, size: int) -> bytearray | None:
        """A buffer of exactly ``size`` bytes that nobody else holds, or None when the pool is at its bound."""
        with self._lock:
            if self._buffers and len(self._buffers[0]) != size:  # another chunk size: the old buffers go
                self._buffers = [b for b in self._buffers if len(b) == size or sys.getrefcount(b) > 3]
            for buffer in self._buffers:
                # referents: the list, ``buffer`` and getrefcount's argument; more is a frame still in use
                if len(buffer) == size and sys.getrefcount(buffer) <= 3:
                    self.reused += 1
                    return buffer
            if self.held_bytes + size > self.max_bytes:
                return None
            self._buffers.append(bytearray(size))
            return self._buffers[-1]

    @property
    def held_bytes(self) -> int:
        return sum(map(len, self._buffers))
