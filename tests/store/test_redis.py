"""What only the Redis backend does: TTL on the server (PEXPIRE), memory policy, adoption after a crash, a blob
Redis dropped on its own, Redis out of memory, Redis gone."""

from __future__ import annotations

import uuid

import pytest
import redis

from prfaas.errors import KVNotFound, KVStoreFull, KVUnavailable
from prfaas.store import BlobStore
from prfaas.store.redis_backend import TTL_GRACE_MS, RedisBackend
from tests.store.test_races import read_verified
from tests.transfer.helpers import assert_clean, assert_same, blob_frames, fill, make_state, run

MiB = 1 << 20


@pytest.fixture
def prefix(redis_url: str) -> object:
    name = f"prfaas:test:{uuid.uuid4().hex[:12]}:"
    yield name
    client = redis.Redis.from_url(redis_url)
    left = list(client.scan_iter(match=name + "*"))
    client.delete(*left) if left else None
    client.close()
    assert not left, f"Redis keys left behind: {left[:5]}"


def test_server_side_ttl_and_policy(redis_url: str, prefix: str) -> None:
    backend = RedisBackend(redis_url, prefix)
    store = BlobStore(64 * MiB, 60, backend=backend)
    kv_id, frames = blob_frames(make_state(layers=1, tokens=32))
    fill(store, kv_id, frames)
    ttl_ms = backend.client.pttl(backend.key(kv_id))
    assert 0 < ttl_ms <= 60_000 + TTL_GRACE_MS  # counted from creation, set once
    assert backend.policy == "noeviction"
    store.release(kv_id)
    assert backend.live_keys() == []
    assert_clean(store)


def test_a_restarted_store_adopts_ready_blobs_and_ends_unfinished_ones(redis_url: str, prefix: str) -> None:
    first = BlobStore(64 * MiB, 120, backend=RedisBackend(redis_url, prefix))
    state = make_state(seed=1)
    ready, half = blob_frames(state), blob_frames(make_state(seed=2))
    fill(first, *ready)
    first.create(half[0], half[1][0])
    first.append(half[0], half[1][1])
    # the process dies here: no close(), the blobs stay in Redis
    second = BlobStore(64 * MiB, 120, backend=RedisBackend(redis_url, prefix))
    assert [(r.kv_id, r.reason) for r in second.records] == [(half[0], "aborted")]
    assert [b.kv_id for b in second.live()] == [ready[0]]
    assert_same(state, run(lambda: read_verified(second, ready[0])).state())
    assert second.release(ready[0]).bytes == sum(map(len, ready[1]))
    assert_clean(second)


def test_a_blob_redis_dropped_is_not_found_never_partial(redis_url: str, prefix: str) -> None:
    backend = RedisBackend(redis_url, prefix)
    store = BlobStore(64 * MiB, 120, backend=backend)
    kv_id, frames = blob_frames(make_state())
    fill(store, kv_id, frames)
    backend.client.delete(backend.key(kv_id))  # as an evicting memory policy would
    with pytest.raises(KVNotFound, match="evicted"):
        run(lambda: read_verified(store, kv_id))
    assert [r.reason for r in store.records] == ["evicted"]
    writing, wframes = blob_frames(make_state(seed=3))
    store.create(writing, wframes[0])
    backend.client.delete(backend.key(writing))
    with pytest.raises(KVNotFound):
        store.append(writing, wframes[1])  # the hash is never re-created without its TTL
    assert backend.live_keys() == []
    assert_clean(store)


def test_redis_out_of_memory_is_store_full(redis_url: str, prefix: str) -> None:
    backend = RedisBackend(redis_url, prefix)
    store = BlobStore(256 * MiB, 120, backend=backend)
    kv_id, frames = blob_frames(make_state(layers=8, tokens=1024))
    used = int(backend.client.info("memory")["used_memory"])
    backend.client.config_set("maxmemory", str(used + 2 * MiB))
    try:
        store.create(kv_id, frames[0])
        with pytest.raises(KVStoreFull, match="Redis is out of memory"):
            for frame in frames[1:-1]:
                store.append(kv_id, frame)
        store.abort(kv_id)
    finally:
        backend.client.config_set("maxmemory", str(256 * MiB))
    assert_clean(store)


def test_redis_unreachable_is_unavailable(tmp_path: object) -> None:
    with pytest.raises(KVUnavailable):
        RedisBackend("redis://127.0.0.1:1/0", "prfaas:test:", timeout_s=0.5)
