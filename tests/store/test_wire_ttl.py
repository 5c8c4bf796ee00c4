"""A Put's ``ttl_ms`` is capped by the store's configuration: a real relay (and a direct-mode prefill's store)
cuts a TTL longer than ``kv_ttl_seconds`` or any tenant's override to that longest allowed TTL, so no writer can
keep a blob alive past what the deployment allows, while a writer whose tenant policy the store lacks still gets
its blob stored; the blob then expires on time and nothing is left behind."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from prfaas.store import BlobStore
from prfaas.transfer import push, release, stat
from tests.store.test_store import Clock
from tests.transfer.helpers import assert_clean, blob_frames, make_state
from tests.transfer.test_memory_bound import store_process

HUGE_S = float(2**40)


@pytest.mark.parametrize("role", ["relay", "prefill"])  # the prefill's store serves direct mode
def test_a_put_cannot_outlive_the_configured_ttl(tmp_path: Path, role: str) -> None:
    """Real store processes: TTLs within the cap are kept as asked; a 2^40 s TTL, and one a second past the
    longest tenant's, are stored for the longest allowed (the process says so) and nothing is left."""
    config, log = tmp_path / "relay.yaml", tmp_path / "store.log"
    config.write_text(yaml.safe_dump({"kv_ttl_seconds": 60, "tenants": {"slow": {"kv_ttl_seconds": 240}}}))

    async def scenario(address: str) -> None:
        asked = [("", 60.0), ("slow", 240.0), ("", 0.0), ("", HUGE_S), ("slow", 241.0)]
        for n, (tenant, ttl_s) in enumerate(asked):
            kv_id, frames = blob_frames(make_state(layers=1, tokens=16, seed=n))
            await push(address, kv_id, frames, timeout_s=5.0, tenant=tenant, ttl_s=ttl_s)
            await release(address, kv_id, timeout_s=5.0)
        assert (await stat(address, timeout_s=5.0))["blobs"] == 0

    with store_process(role, str(config), log=log) as (address, _):
        asyncio.run(scenario(address))
    cuts = [line for line in log.read_text().splitlines() if "kept for this store's longest, 240 s" in line]
    assert len(cuts) == 2, cuts


def test_a_blob_asking_to_live_longer_expires_at_the_stores_longest_ttl() -> None:
    clock = Clock()
    store = BlobStore(64 << 20, 60, clock=clock, max_ttl_s=240)
    kept, frames = blob_frames(make_state(layers=1, tokens=16))
    store.create(kept, frames[0], ttl_s=HUGE_S)
    for frame in frames[1:-1]:
        store.append(kept, frame)
    store.finish(kept, frames[-1])
    clock.now += 239
    assert store.sweep() == []
    clock.now += 1
    assert [(r.kv_id, r.reason) for r in store.sweep()] == [(kept, "expired")]
    assert_clean(store)
