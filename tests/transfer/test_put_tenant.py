"""A Put names the blob's tenant and its own TTL: the relay's store keeps both (records, expiry)."""

from __future__ import annotations

from prfaas.store import AccessRecord
from prfaas.transfer import push, release
from tests.transfer.helpers import blob_frames, make_state, run
from tests.transfer.test_transfer import Served


def test_put_carries_tenant_and_ttl_into_the_store() -> None:
    kv_id, frames = blob_frames(make_state())
    accesses: list[AccessRecord] = []

    async def scenario() -> None:
        async with Served(ttl_s=300.0, on_access=accesses.append) as relay:
            await push(relay.address, kv_id, frames, timeout_s=2.0, tenant="acme", ttl_s=60.0)
            blob = relay.store._live[kv_id]
            assert (blob.tenant, blob.ttl_s) == ("acme", 60.0)
            record = await release(relay.address, kv_id, timeout_s=2.0)
            assert record["tenant"] == "acme"

    run(scenario)
    assert {a.action for a in accesses} >= {"create", "finish", "release"}
    assert all(a.tenant == "acme" for a in accesses)
