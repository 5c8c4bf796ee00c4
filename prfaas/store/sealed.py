"""Encryption at rest: ``SealedBackend`` wraps any ``FrameBackend`` so that every frame it holds is AES-256-GCM
ciphertext under a data key of its own blob.

- Each blob gets a fresh random 256-bit data key at ``start``. The store process keeps it only wrapped (RFC 3394
  AES key wrap) by the master key, and only in its own memory: the backend (this process's frames, or Redis and
  every copy, replica or snapshot of it) holds ciphertext and never a key.
- Each frame is ``nonce (12 bytes) || ciphertext || tag (16 bytes)`` with the blob's id and the frame's slot as
  associated data, so a frame cannot be replayed into another blob or another position.
- ``drop`` (every end of a blob: release, expiry, eviction, abort, shutdown) destroys the wrapped data key first;
  the deletion record says so (``key_destroyed``). A copy of the ciphertext taken before then can no longer be
  decrypted by anyone, the store included.
- A restarted store cannot read what a previous process left in Redis (its keys died with it): ``leftovers``
  drops those blobs instead of adopting them, and the audit log records their end.

The master key comes from ``$PRFAAS_STORE_KEY`` (base64 of 32 bytes) or the file ``store_key_file`` (32 raw bytes
or their base64; refused if readable by group or others). Create one with ``prfaas admin store-key PATH``.
Speed: frames are sealed into reused buffers (``encrypt_into``). Fresh memory costs a page fault per 4 KiB on
first touch, which on small VMs is slower than the cipher itself, so the buffers of ended blobs (or, for a backend
that copies what it is given, such as Redis, of every write) go back to a bounded pool for the next blob's frames.
What this does not do: Python cannot promise that freed memory is overwritten, so a dump of the live store
process's memory is outside this protection; the master key is only as safe as the file or environment holding it.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import stat
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import aes_key_unwrap, aes_key_wrap

from prfaas.errors import InvalidRequest, KVCorrupt, KVNotFound
from prfaas.store.backend import BlobMeta, FrameBackend

log = logging.getLogger(__name__)
KEY_ENV = "PRFAAS_STORE_KEY"
NONCE = 12
OVERHEAD = NONCE + 16  # bytes a sealed frame adds
POOL_BYTES = 256 << 20  # free frame buffers kept for reuse (at most)


class SealedBackend:
    sealed = True

    def __init__(self, inner: FrameBackend, master_key: bytes, pool_bytes: int = POOL_BYTES) -> None:
        if len(master_key) != 32:
            raise InvalidRequest("the store master key must be 32 bytes (AES-256)")
        self.inner, self.name = inner, f"{inner.name}+aes-256-gcm"
        self._kek = master_key
        self._keys: dict[str, bytes] = {}  # kv_id → data key wrapped by the master key; nowhere else
        self._holds = getattr(inner, "holds_frames", True)  # keeps our buffers (memory) or copies them (Redis)
        self._buffers: dict[str, list[bytearray]] = {}  # what the inner backend holds of ours, per blob
        self._pool = _Pool(pool_bytes)

    # -- FrameBackend ------------------------------------------------------------------------------------------

    def start(self, meta: BlobMeta, header: bytes, ttl_s: float) -> None:
        data_key = AESGCM.generate_key(bit_length=256)
        self._keys[meta.kv_id] = aes_key_wrap(self._kek, data_key)
        self._buffers[meta.kv_id] = []
        sealed = self._seal(data_key, meta.kv_id, -1, header)
        self.inner.start(meta, sealed, ttl_s)  # type: ignore[arg-type]  # bytes-like, stored or copied as is
        self._done_with(meta.kv_id, sealed)

    def put(self, meta: BlobMeta, slot: int, frame: bytes) -> bool:
        data_key = self._data_key(meta.kv_id)
        if data_key is None:
            return False
        sealed = self._seal(data_key, meta.kv_id, slot, frame)
        kept = self.inner.put(meta, slot, sealed)  # type: ignore[arg-type]
        self._done_with(meta.kv_id, sealed)
        return kept

    def get(self, kv_id: str, slot: int) -> bytes | None:
        data_key = self._data_key(kv_id)
        value = self.inner.get(kv_id, slot) if data_key is not None else None
        return None if value is None or data_key is None else _open(data_key, kv_id, slot, value)

    def drop(self, kv_id: str) -> None:
        self._keys.pop(kv_id, None)  # crypto-erasure first: whatever the backend still holds is unreadable now
        self.inner.drop(kv_id)
        for buffer in self._buffers.pop(kv_id, []):
            self._pool.give(buffer)

    def leftovers(self) -> list[BlobMeta]:
        left = self.inner.leftovers()
        for meta in left:
            log.warning("dropping blob %s left by a previous store: its data key died with that process",
                        meta.kv_id)
            self.inner.drop(meta.kv_id)
        return []

    def close(self) -> None:
        self._keys.clear()
        self._buffers.clear()
        self._pool = _Pool(0)
        self.inner.close()

    # -- for operators and tests -------------------------------------------------------------------------------

    def has_key(self, kv_id: str) -> bool:
        return kv_id in self._keys

    def open_copy(self, kv_id: str, slot: int, value: bytes) -> bytes:
        """Decrypt a frame ``value`` (as the inner backend held it) with the blob's current key; ``KVNotFound``
        once the blob's key is destroyed, ``KVCorrupt`` if the value was altered."""
        data_key = self._data_key(kv_id)
        if data_key is None:
            raise KVNotFound(f"the data key of blob {kv_id} is destroyed; its ciphertext cannot be decrypted")
        return _open(data_key, kv_id, slot, value)

    def _seal(self, data_key: bytes, kv_id: str, slot: int, frame: bytes) -> bytearray:
        """``nonce || AES-256-GCM(frame) || tag`` in a buffer from the pool (or a new one)."""
        sealed = self._pool.take(len(frame) + OVERHEAD)
        nonce = os.urandom(NONCE)
        sealed[:NONCE] = nonce
        AESGCM(data_key).encrypt_into(nonce, frame, _aad(kv_id, slot), memoryview(sealed)[NONCE:])
        return sealed

    def _done_with(self, kv_id: str, sealed: bytearray) -> None:
        """The inner backend has ``sealed``: it keeps it until the blob drops, or copied it and it is free now."""
        if self._holds and kv_id in self._buffers:
            self._buffers[kv_id].append(sealed)
        else:
            self._pool.give(sealed)

    def _data_key(self, kv_id: str) -> bytes | None:
        wrapped = self._keys.get(kv_id)
        return None if wrapped is None else aes_key_unwrap(self._kek, wrapped)


class _Pool:
    """Free buffers by exact size, at most ``limit`` bytes in all (frames of one chunk size are one size)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self._free: dict[int, list[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        free = self._free.get(size)
        if free:
            self.held -= size
            return free.pop()
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        if self.held + len(buffer) <= self.limit:
            self._free.setdefault(len(buffer), []).append(buffer)
            self.held += len(buffer)


def _aad(kv_id: str, slot: int) -> bytes:
    return kv_id.encode() + struct.pack(">i", slot)


def _open(data_key: bytes, kv_id: str, slot: int, value: bytes) -> bytes:
    try:
        return AESGCM(data_key).decrypt(value[:NONCE], value[NONCE:], _aad(kv_id, slot))
    except InvalidTag as exc:
        raise KVCorrupt(f"frame {slot} of blob {kv_id} failed its authentication tag at rest") from exc


def new_master_key(path: str) -> None:
    """Write a fresh master key to ``path`` (base64, mode 0600); refuses to overwrite one."""
    key = base64.b64encode(AESGCM.generate_key(bit_length=256)) + b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise InvalidRequest(f"{path} exists; a store key is never overwritten (blobs sealed with it would be "
                             "lost)") from exc
    with os.fdopen(fd, "wb") as out:
        out.write(key)


def load_master_key(key_file: str) -> bytes | None:
    """The master key from ``$PRFAAS_STORE_KEY`` or ``key_file``; ``None`` when neither is set (no encryption at
    rest). ``InvalidRequest`` for a key that is not 32 bytes or a file readable by group or others."""
    text = os.environ.get(KEY_ENV, "").encode()
    where = f"${KEY_ENV}"
    if not text and key_file:
        mode = os.stat(key_file).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InvalidRequest(f"store key file {key_file} is readable by others; run `chmod 600 {key_file}`")
        with open(key_file, "rb") as f:
            text, where = f.read(), key_file
    if not text:
        return None
    key = text if len(text) == 32 else _b64(text.strip(), where)
    if len(key) != 32:
        raise InvalidRequest(f"the store key in {where} must be 32 bytes (or their base64), not {len(key)}")
    return key


def _b64(text: bytes, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise InvalidRequest(f"the store key in {where} is neither 32 raw bytes nor base64") from exc
