"""The store as a process runs it (``StoreRuntime``) behind a real data-plane server, on each backend: the audit
log names the peer of every access, the router's ``release_abandoned`` ends a blob once and never raises, and
closing leaves nothing in the store, in Redis or in the log."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from prfaas.audit import verify
from prfaas.audit.report import blob_story, entries
from prfaas.config import Config
from prfaas.kv import BlobReader
from prfaas.services.kvstore import StoreRuntime
from prfaas.transfer import pull, push
from prfaas.transfer.abandon import release_abandoned
from tests.transfer.helpers import assert_same, blob_frames, make_state, run


@pytest.fixture
def runtime(request: pytest.FixtureRequest, backend_name: str, tmp_path: Path) -> StoreRuntime:
    url = request.getfixturevalue("redis_url") if backend_name == "redis" else "redis://unused"
    config = Config().replace(store_backend=backend_name, redis_url=url, audit_log=str(tmp_path / "{instance}.jsonl"),
                              store_budget_mb=64)
    return StoreRuntime(config, f"relay-{uuid.uuid4().hex[:8]}")


def test_peers_are_on_record_and_abandoned_blobs_end_once(runtime: StoreRuntime) -> None:
    state = make_state()
    kv_id, frames = blob_frames(state)
    other, other_frames = blob_frames(make_state(seed=1))

    async def scenario() -> None:
        server = runtime.server("127.0.0.1", 0)
        address = f"127.0.0.1:{await server.start()}"
        try:
            await push(address, kv_id, frames, timeout_s=5.0)
            await push(address, other, other_frames, timeout_s=5.0)
            assert_same(state, await pull(address, kv_id, BlobReader(), timeout_s=5.0))
            assert_same(state, await pull(address, kv_id, BlobReader(), timeout_s=5.0))  # idempotent re-read
            assert (await release_abandoned(address, kv_id) or {}).get("reason") == "released"
            assert await release_abandoned(address, kv_id) is None  # already ended: nothing to do
            assert await release_abandoned("127.0.0.1:1", other, timeout_s=0.5) is None  # unreachable: TTL
        finally:
            await server.close()

    run(scenario)
    runtime.sweep()
    assert [b["kv_id"] for b in runtime.debug()["blobs"]] == [other]
    assert [r.reason for r in runtime.close()] == ["shutdown"]
    assert runtime.debug()["blobs"] == []
    if runtime.store.backend.name == "redis":
        assert runtime.store.backend.live_keys() == []  # type: ignore[attr-defined]
    assert runtime.audit is not None
    path = runtime.audit.chain.path
    verdict = verify(path)
    assert verdict.ok and verdict.created == 2 and dict(verdict.ended) == {"released": 1, "shutdown": 1}
    story = blob_story(entries([path]), kv_id)
    assert [(a["action"], a["who"], a["outcome"]) for a in story["accesses"]] == [
        ("create", "127.0.0.1", "ok"), ("finish", "127.0.0.1", "ok"), ("read", "127.0.0.1", "ok"),
        ("read", "127.0.0.1", "ok"), ("release", "127.0.0.1", "ok"), ("release", "127.0.0.1", "KV_NOT_FOUND")]
    stats = runtime.stats()
    assert stats["backend"] == runtime.store.backend.name and stats["audit"]["seq"] == verdict.entries
