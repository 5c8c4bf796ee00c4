"""A blob's tenant and its own TTL: every record of the blob carries the tenant; its TTL overrides the store's."""

from __future__ import annotations

import pytest

from prfaas.errors import InvalidRequest
from prfaas.store import AccessRecord, DeletionRecord, accessing
from tests.store.conftest import StoreFactory
from tests.store.test_store import Clock, read_all
from tests.transfer.helpers import blob_frames, fill, make_state, run

MiB = 1 << 20


def test_records_carry_the_tenant_and_the_blob_keeps_its_own_ttl(make_store: StoreFactory) -> None:
    clock, accesses, deletions = Clock(), list[AccessRecord](), list[DeletionRecord]()
    store = make_store(64 * MiB, 120, clock=clock, on_access=accesses.append, on_delete=deletions.append)
    short, frames = blob_frames(make_state(seed=1))
    with accessing(who="prefill-0", tenant="acme"):
        store.create(short, frames[0], ttl_s=60)
    for frame in frames[1:-1]:
        store.append(short, frame)
    store.finish(short, frames[-1])
    long_id, long_frames = blob_frames(make_state(seed=2))
    fill(store, long_id, long_frames)  # no tenant, the store's TTL
    run(lambda: read_all(store, short))
    clock.now += 61
    assert [r.kv_id for r in store.sweep()] == [short]
    assert {a.action for a in accesses if a.kv_id == short} == {"create", "finish", "read"}
    assert all(a.tenant == "acme" for a in accesses if a.kv_id == short)
    assert all(a.tenant == "" for a in accesses if a.kv_id == long_id)
    assert (deletions[0].tenant, deletions[0].reason, deletions[0].key_destroyed) == ("acme", "expired", False)
    bad, bad_frames = blob_frames(make_state(seed=3))
    with pytest.raises(InvalidRequest, match="TTL"):
        store.create(bad, bad_frames[0], ttl_s=-1)
    store.release(long_id)
    store.close()

