"""Release races, real-time TTL, restarts and access records, on every backend: a reader gets the whole blob or
an error, never a blob with frames missing, and every blob ends in exactly one record."""

from __future__ import annotations

import asyncio
import time

import pytest

from prfaas.errors import KVExpired, KVNotFound, KVUnavailable, PrfaasError
from prfaas.kv import BlobReader
from prfaas.store import AccessRecord, BlobStore, accessing
from tests.store.conftest import StoreFactory
from tests.transfer.helpers import assert_clean, assert_same, blob_frames, fill, make_state, run

MiB = 1 << 20


async def read_verified(store: BlobStore, kv_id: str, pause_s: float = 0.0) -> BlobReader:
    """Read the blob the way decode does (every frame verified); ``pause_s`` between frames."""
    reader = BlobReader()
    async for frame in store.frames(kv_id, timeout_s=2.0):
        reader.feed(frame)
        await asyncio.sleep(pause_s)
    return reader


def test_release_during_a_read_fails_the_reader_cleanly(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    kv_id, frames = blob_frames(make_state())
    fill(store, kv_id, frames)

    async def scenario() -> None:
        task = asyncio.create_task(read_verified(store, kv_id, pause_s=0.005))
        await asyncio.sleep(0.02)
        store.release(kv_id)
        with pytest.raises(KVNotFound, match="released"):
            await task  # the reader stops with an error, it never returns a blob with chunks missing

    run(scenario)
    assert store.stats().readers == 0 and [r.reason for r in store.records] == ["released"]
    assert_clean(store)


def test_double_release_and_read_after_release(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    state = make_state()
    kv_id, frames = blob_frames(state)
    fill(store, kv_id, frames)
    first = run(lambda: read_verified(store, kv_id))
    second = run(lambda: read_verified(store, kv_id))  # a retry reads the same blob again
    assert_same(state, first.state())
    assert_same(state, second.state())
    store.release(kv_id)
    with pytest.raises(KVNotFound):
        store.release(kv_id)
    with pytest.raises(KVNotFound):
        run(lambda: read_verified(store, kv_id))
    assert len(store.records) == 1
    assert_clean(store)


def test_release_of_a_blob_still_being_written_stops_its_writer(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    kv_id, frames = blob_frames(make_state())
    store.create(kv_id, frames[0])
    store.append(kv_id, frames[1])
    assert store.release(kv_id).reason == "released"  # the router gave up on the request
    with pytest.raises(KVNotFound):
        store.append(kv_id, frames[2])
    with pytest.raises(KVNotFound):
        store.abort(kv_id)
    assert_clean(store)


def test_ttl_expiry_in_real_time(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 0.3)
    kv_id, frames = blob_frames(make_state(layers=1, tokens=32))
    fill(store, kv_id, frames)
    time.sleep(0.35)
    with pytest.raises(KVExpired):
        run(lambda: read_verified(store, kv_id))
    assert [r.reason for r in store.records] == ["expired"] and store.sweep() == []
    assert_clean(store)


def test_closing_the_store_fails_readers_and_a_new_store_starts_clean(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    done, writing = blob_frames(make_state(seed=1)), blob_frames(make_state(seed=2))
    fill(store, *done)
    store.create(writing[0], writing[1][0])

    async def scenario() -> None:
        reader = asyncio.create_task(read_verified(store, done[0], pause_s=0.005))
        waiter = asyncio.create_task(read_verified(store, writing[0]))
        await asyncio.sleep(0.02)
        store.close()  # the store process shuts down
        for task in (reader, waiter):
            with pytest.raises(KVUnavailable):
                await task

    run(scenario)
    assert sorted(r.reason for r in store.records) == ["shutdown", "shutdown"]
    late, late_frames = blob_frames(make_state(seed=3))
    with pytest.raises(KVUnavailable):
        store.create(late, late_frames[0])
    assert_clean(store)
    fresh = make_store(64 * MiB, 120)
    assert fresh.stats().blobs == 0 and fresh.live() == []
    with pytest.raises(KVNotFound):  # the client retries elsewhere or re-prefills
        fresh.release(done[0])


def test_access_records_name_who_and_why(make_store: StoreFactory) -> None:
    seen: list[AccessRecord] = []
    store = make_store(64 * MiB, 120, on_access=seen.append, owner="relay-0")
    kv_id, frames = blob_frames(make_state(layers=1, tokens=32))
    fill(store, kv_id, frames)
    with accessing(who="decode-1@10.0.0.2", purpose="req-7"):
        run(lambda: read_verified(store, kv_id))
        store.release(kv_id)
    with pytest.raises(PrfaasError):
        store.release(kv_id)
    got = [(r.action, r.who, r.purpose, r.outcome) for r in seen]
    assert got == [("create", "relay-0", "", "ok"), ("finish", "relay-0", "", "ok"),
                   ("read", "decode-1@10.0.0.2", "req-7", "ok"), ("release", "decode-1@10.0.0.2", "req-7", "ok"),
                   ("release", "relay-0", "", "KV_NOT_FOUND")]
    size = sum(map(len, frames))
    assert [r.bytes for r in seen[1:4]] == [size, size, size]
    assert_clean(store)
