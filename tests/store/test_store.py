"""The store suite, run against every backend (``make_store``): states, release, TTL, LRU, budget, records."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from prfaas.errors import (
    InvalidRequest,
    KVBadFormat,
    KVCorrupt,
    KVExpired,
    KVNotFound,
    KVStoreFull,
    KVTimeout,
    KVTruncated,
    KVUnavailable,
)
from prfaas.kv import BlobReader
from prfaas.store import BlobStore, DeletionRecord
from tests.clock import Clock
from tests.store.conftest import StoreFactory
from tests.transfer.helpers import assert_clean, assert_same, blob_frames, fill, make_state, run

MiB = 1 << 20



async def read_all(store: BlobStore, kv_id: str, from_chunk: int = 0, timeout_s: float = 2.0) -> list[bytes]:
    return [frame async for frame in store.frames(kv_id, from_chunk, timeout_s)]


def test_state_machine_and_release(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    kv_id, frames = blob_frames(make_state())
    store.create(kv_id, frames[0])
    assert store.stats().writing == 1
    for frame in frames[1:-1]:
        store.append(kv_id, frame)
    store.finish(kv_id, frames[-1])
    stats = store.stats()
    assert (stats.ready, stats.writing, stats.bytes) == (1, 0, sum(map(len, frames)))
    assert run(lambda: read_all(store, kv_id)) == frames
    assert run(lambda: read_all(store, kv_id)) == frames  # idempotent until release
    record = store.release(kv_id)
    assert (record.reason, record.bytes, record.chunks) == ("released", stats.bytes, len(frames) - 2)
    assert record.payload_xxh64 is not None and record.deleted_ms >= record.created_ms
    with pytest.raises(KVNotFound, match="released"):
        store.release(kv_id)
    with pytest.raises(KVNotFound):
        run(lambda: read_all(store, kv_id))
    with pytest.raises(InvalidRequest):
        store.create(kv_id, frames[0])  # a used id is never reused
    assert store.records == [record]
    assert_clean(store)


def test_resume_from_chunk_yields_header_then_the_rest(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    kv_id, frames = blob_frames(make_state())
    fill(store, kv_id, frames)
    assert run(lambda: read_all(store, kv_id, 5)) == [frames[0], *frames[6:]]
    assert run(lambda: read_all(store, kv_id, len(frames) - 2)) == [frames[0], frames[-1]]
    with pytest.raises(InvalidRequest):
        run(lambda: read_all(store, kv_id, len(frames)))
    store.release(kv_id)
    assert_clean(store)


def test_bad_writes_are_refused(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    kv_id, frames = blob_frames(make_state())
    other, other_frames = blob_frames(make_state(seed=1))
    with pytest.raises(KVBadFormat):
        store.create(other, frames[0])  # header names another blob
    with pytest.raises((KVBadFormat, KVCorrupt)):
        store.create(kv_id, frames[0][:-1])
    store.create(kv_id, frames[0])
    with pytest.raises(InvalidRequest):
        store.create(kv_id, frames[0])
    with pytest.raises(KVBadFormat, match="out of order"):
        store.append(kv_id, frames[2])
    damaged = bytearray(frames[1])
    damaged[-1] ^= 1
    with pytest.raises(KVCorrupt):
        store.append(kv_id, bytes(damaged))
    store.append(kv_id, frames[1])
    with pytest.raises(KVCorrupt, match="trailer"):
        store.finish(kv_id, frames[-1])  # chunks missing
    with pytest.raises(KVNotFound):
        store.append(other, other_frames[1])
    record = store.abort(kv_id)
    assert (record.reason, record.payload_xxh64) == ("aborted", None)
    assert_clean(store)


def test_ttl_expiry_with_an_injected_clock(make_store: StoreFactory) -> None:
    clock = Clock(1000.0)
    store = make_store(64 * MiB, 120, clock=clock)
    kv_a, frames_a = blob_frames(make_state())
    kv_b, frames_b = blob_frames(make_state(seed=1))
    fill(store, kv_a, frames_a)
    clock.now += 60
    store.create(kv_b, frames_b[0])  # still writing when its TTL passes
    clock.now += 59
    assert store.sweep() == []
    clock.now += 1  # TTL is counted from creation: kv_a is 120 s old now
    assert [r.kv_id for r in store.sweep()] == [kv_a]
    with pytest.raises(KVExpired):
        run(lambda: read_all(store, kv_a))
    with pytest.raises(KVExpired):
        store.release(kv_a)
    clock.now += 59
    assert store.sweep() == []
    clock.now += 1
    with pytest.raises(KVExpired):  # found expired by the reader itself, before any sweep
        run(lambda: read_all(store, kv_b))
    assert [(r.kv_id, r.reason, r.payload_xxh64) for r in store.records][1] == (kv_b, "expired", None)
    with pytest.raises(KVNotFound, match="unknown"):
        store.release(blob_frames(make_state(seed=2))[0])
    assert_clean(store)


def test_lru_eviction_spares_blobs_being_read(make_store: StoreFactory) -> None:
    states = [blob_frames(make_state(seed=i)) for i in range(4)]
    size = sum(map(len, states[0][1]))
    store = make_store(2 * size + size // 2, 120)
    fill(store, *states[0])
    fill(store, *states[1])

    async def scenario() -> None:
        reading = store.frames(states[0][0])
        await anext(reading)  # blob 0 (the least recently used) is being read
        fill(store, *states[2])  # needs room: blob 1 is evicted, not blob 0
        assert [r.reason for r in store.records] == ["evicted"]
        assert store.records[0].kv_id == states[1][0]
        also = store.frames(states[2][0])
        await anext(also)
        with pytest.raises(KVStoreFull):
            fill(store, *states[3])  # both ready blobs are being read: nothing may be evicted
        store.abort(states[3][0])  # an aborted id may be written again
        assert [frame async for frame in reading] == states[0][1][1:]
        assert [frame async for frame in also] == states[2][1][1:]

    run(scenario)
    with pytest.raises(KVNotFound, match="evicted"):
        run(lambda: read_all(store, states[1][0]))
    fill(store, *states[3])  # nobody reads 0 now: it is evicted
    assert store.records[-1].kv_id == states[0][0]
    assert {r.reason for r in store.close()} == {"shutdown"}
    fresh_id, fresh = blob_frames(make_state(seed=9))
    with pytest.raises(KVUnavailable):
        store.create(fresh_id, fresh[0])
    assert_clean(store)


def test_over_budget_writes_get_store_full_not_memory(make_store: StoreFactory) -> None:
    kv_id, frames = blob_frames(make_state())
    store = make_store(len(frames[0]) + len(frames[1]) + 10, 120)
    store.create(kv_id, frames[0])
    store.append(kv_id, frames[1])
    with pytest.raises(KVStoreFull):
        store.append(kv_id, frames[2])
    assert store.stats().writing == 1  # the writer decides: retry later or abort
    store.abort(kv_id)
    assert_clean(store)


def test_reader_started_before_the_writer_gets_every_layer(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    state = make_state()
    kv_id, frames = blob_frames(state)
    store.create(kv_id, frames[0])

    async def writer() -> None:
        for frame in frames[1:-1]:
            await asyncio.sleep(0.002)
            store.append(kv_id, frame)
        store.finish(kv_id, frames[-1])

    async def scenario() -> BlobReader:
        reader, layer_times = BlobReader(), []
        task = asyncio.create_task(writer())
        async for frame in store.frames(kv_id, timeout_s=1.0):
            if reader.feed(frame):
                layer_times.append(task.done())
        await task
        assert layer_times[0] is False  # the first layer was usable while the blob was still being written
        return reader

    assert_same(state, run(scenario).state())
    store.release(kv_id)
    assert_clean(store)


def test_writer_in_another_thread_wakes_the_reader(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    kv_id, frames = blob_frames(make_state())
    store.create(kv_id, frames[0])

    def write() -> None:
        for frame in frames[1:-1]:
            time.sleep(0.001)
            store.append(kv_id, frame)
        store.finish(kv_id, frames[-1])

    thread = threading.Thread(target=write)
    thread.start()
    assert run(lambda: read_all(store, kv_id, timeout_s=2.0)) == frames
    thread.join()
    store.release(kv_id)
    assert_clean(store)


def test_stalled_writer_times_out_and_abort_truncates(make_store: StoreFactory) -> None:
    store = make_store(64 * MiB, 120)
    kv_id, frames = blob_frames(make_state())
    store.create(kv_id, frames[0])
    store.append(kv_id, frames[1])
    start = time.monotonic()
    with pytest.raises(KVTimeout):
        run(lambda: read_all(store, kv_id, timeout_s=0.2))
    assert 0.2 <= time.monotonic() - start < 1.0

    async def aborted_while_waiting() -> None:
        task = asyncio.create_task(read_all(store, kv_id, timeout_s=5.0))
        await asyncio.sleep(0.05)
        store.abort(kv_id)
        with pytest.raises(KVTruncated):
            await task

    run(aborted_while_waiting)
    with pytest.raises(KVTruncated):
        run(lambda: read_all(store, kv_id))
    assert store.stats().readers == 0
    assert_clean(store)


def test_every_blob_ends_in_exactly_one_record(make_store: StoreFactory) -> None:
    clock, seen = Clock(1000.0), []
    blobs = [blob_frames(make_state(layers=1, tokens=64, seed=i)) for i in range(6)]
    size = sum(map(len, blobs[0][1]))
    store = make_store(3 * size, 120, on_delete=seen.append, clock=clock)
    for kv_id, frames in blobs[:4]:
        fill(store, kv_id, frames)  # the 4th evicts the 1st
    store.release(blobs[1][0])
    store.create(blobs[4][0], blobs[4][1][0])
    store.abort(blobs[4][0])
    clock.now += 200
    store.sweep()
    fill(store, *blobs[5])
    store.close()
    assert seen == store.records and all(isinstance(r, DeletionRecord) for r in seen)
    assert [r.reason for r in seen] == ["evicted", "released", "aborted", "expired", "expired", "shutdown"]
    assert_clean(store)
