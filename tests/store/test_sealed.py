"""Encryption at rest (``SealedBackend``) on both backends: what a store holds is ciphertext, a deleted blob's
earlier copy cannot be decrypted, tampering is caught, and a restarted store drops what it cannot read."""

from __future__ import annotations

import base64
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from prfaas.errors import InvalidRequest, KVCorrupt, KVNotFound
from prfaas.store import BlobStore, MemoryBackend
from prfaas.store.backend import HEADER, TRAILER
from prfaas.store.sealed import KEY_ENV, SealedBackend, load_master_key, new_master_key
from tests.store.conftest import BACKENDS
from tests.store.test_store import read_all
from tests.transfer.helpers import blob_frames, fill, make_state, run

MASTER = bytes(range(32))
MiB = 1 << 20


@pytest.fixture(params=BACKENDS)
def sealed(request: pytest.FixtureRequest) -> Iterator[tuple[SealedBackend, Callable[[str], dict[int, bytes]]]]:
    """A sealed backend and ``raw(kv_id)``: every value the inner backend holds for a blob, as stored."""
    if request.param == "memory":
        inner = MemoryBackend()
        backend = SealedBackend(inner, MASTER)
        yield backend, lambda kv_id: {k: bytes(v) for k, v in inner._blobs.get(kv_id, {}).items()}
        return
    import redis

    from prfaas.store.redis_backend import RedisBackend

    url = request.getfixturevalue("redis_url")
    prefix = f"prfaas:test:{uuid.uuid4().hex[:12]}:"
    rb = RedisBackend(url, prefix)
    client = redis.Redis.from_url(url)

    def raw(kv_id: str) -> dict[int, bytes]:
        values = client.hgetall(prefix + kv_id)
        slot = {b"h": HEADER, b"t": TRAILER}
        return {slot.get(k, int(k[2:]) if k.startswith(b"c:") else -99): bytes(v) for k, v in values.items()
                if not k.startswith(b"m:")}

    yield SealedBackend(rb, MASTER), raw
    left = list(client.scan_iter(match=prefix + "*"))
    client.close()
    assert not left, f"Redis keys left behind: {left[:3]}"


def _windows(frame: bytes, width: int = 48) -> list[bytes]:
    step = max(width, len(frame) // 64)
    return [frame[i:i + width] for i in range(0, len(frame) - width, step)]


def test_blobs_at_rest_are_ciphertext_and_read_back_exactly(sealed: tuple) -> None:
    backend, raw = sealed
    store = BlobStore(64 * MiB, 120, backend=backend)
    kv_id, frames = blob_frames(make_state())
    fill(store, kv_id, frames)
    held = raw(kv_id)
    assert len(held) == len(frames)
    stored = b"".join(held.values())
    leaks = [w for frame in frames for w in _windows(frame) if w in stored]
    assert not leaks, f"{len(leaks)} plaintext windows found at rest"
    assert kv_id.encode() not in stored  # not even the header's id is readable
    assert run(lambda: read_all(store, kv_id)) == frames
    store.release(kv_id)
    store.close()


def test_a_deleted_blob_cannot_be_decrypted_from_a_copy_taken_before(sealed: tuple) -> None:
    backend, raw = sealed
    store = BlobStore(64 * MiB, 120, backend=backend)
    kv_id, frames = blob_frames(make_state())
    fill(store, kv_id, frames)
    copy = raw(kv_id)
    assert backend.open_copy(kv_id, 0, copy[0]) == frames[1]  # the copy is complete and readable now
    record = store.release(kv_id)
    assert record.key_destroyed and not backend.has_key(kv_id)
    assert raw(kv_id) == {}
    for slot, value in copy.items():
        with pytest.raises(KVNotFound, match="data key"):
            backend.open_copy(kv_id, slot, value)
        with pytest.raises(InvalidTag):  # nor does the master key open it: it only ever wrapped the data key
            AESGCM(MASTER).decrypt(value[:12], value[12:], None)
    store.close()


def test_every_end_destroys_the_key_and_tampering_is_caught(sealed: tuple) -> None:
    backend, raw = sealed
    store = BlobStore(64 * MiB, 120, backend=backend)
    kv_id, frames = blob_frames(make_state(seed=1))
    fill(store, kv_id, frames)
    damaged = bytearray(raw(kv_id)[1])
    damaged[40] ^= 1
    backend.inner.put(store._live[kv_id].meta(), 1, bytes(damaged))
    with pytest.raises(KVCorrupt, match="authentication tag"):
        run(lambda: read_all(store, kv_id))
    other, frames = blob_frames(make_state(seed=2))
    fill(store, other, frames)
    ended = store.close()
    assert {r.kv_id for r in ended} == {kv_id, other} and all(r.key_destroyed for r in ended)


def test_a_restarted_store_drops_blobs_it_cannot_read(redis_url: str) -> None:
    from prfaas.store.redis_backend import RedisBackend

    prefix = f"prfaas:test:{uuid.uuid4().hex[:12]}:"
    first = BlobStore(64 * MiB, 120, backend=SealedBackend(RedisBackend(redis_url, prefix), MASTER))
    kv_id, frames = blob_frames(make_state())
    fill(first, kv_id, frames)  # the process dies here: no close, its data keys die with it
    second_backend = SealedBackend(RedisBackend(redis_url, prefix), MASTER)
    second = BlobStore(64 * MiB, 120, backend=second_backend)
    assert second.live() == [] and second_backend.inner.live_keys() == []
    second.close()
    first.backend.inner.close()  # type: ignore[attr-defined]


def test_master_key_sources_and_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert load_master_key("") is None
    path = tmp_path / "store.key"
    new_master_key(str(path))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert len(load_master_key(str(path)) or b"") == 32
    with pytest.raises(InvalidRequest, match="never overwritten"):
        new_master_key(str(path))
    os.chmod(path, 0o644)
    with pytest.raises(InvalidRequest, match="readable by others"):
        load_master_key(str(path))
    monkeypatch.setenv(KEY_ENV, base64.b64encode(MASTER).decode())
    assert load_master_key(str(path)) == MASTER  # the environment wins over the file
    monkeypatch.setenv(KEY_ENV, base64.b64encode(b"short").decode())
    with pytest.raises(InvalidRequest, match="32 bytes"):
        load_master_key("")
    with pytest.raises(InvalidRequest, match="32 bytes"):
        SealedBackend(MemoryBackend(), b"short")

