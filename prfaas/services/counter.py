"""``Counter``: an integer the event loop and an engine thread both change (a scheduler's queue depth)."""

from __future__ import annotations

import threading


class Counter:
    """An integer changed from two threads (the event loop submits, the engine thread takes): ``+=`` on a plain
    attribute is a read-modify-write that can lose an update, so every change holds a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self, delta: int) -> None:
        with self._lock:
            self._value += delta

    @property
    def value(self) -> int:
        return self._value
