"""The in-memory store: ``BlobStore`` with its default ``MemoryBackend`` (frames in this process).

Kept as the import path the data plane uses (``from prfaas.store.memory import BlobStore``); the rules live in
``prfaas.store.core`` and apply to every backend.
"""

from __future__ import annotations

from prfaas.store.backend import MemoryBackend
from prfaas.store.core import BlobStore

__all__ = ["BlobStore", "MemoryBackend"]
