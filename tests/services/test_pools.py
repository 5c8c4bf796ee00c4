"""Pools by fingerprint: refusal of unlisted models, canary weights, draining instances, format negotiation."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from prfaas.errors import InvalidRequest, KVBadFormat, KVIncompatible
from prfaas.kv import BlobWriter, Fingerprint, KVState, decode_state
from prfaas.kv import fingerprint as fp_module
from prfaas.kv import format as format_module
from prfaas.messages import InstanceInfo
from prfaas.services.registry import Registry, pool_of
from tests.kv.test_format import make_state

OLD = Fingerprint("m-old", "llama", "w1", "t1", "float32", 2048)
NEW = Fingerprint("m-new", "llama", "w2", "t1", "float32", 2048)


def info(iid: str, role: str, fp: Fingerprint | None, **extra: object) -> InstanceInfo:
    return InstanceInfo.from_json({"instance_id": iid, "role": role, "url": f"http://{iid}",
                                   "fingerprint": fp.to_wire() if fp else {}, **extra})


def test_without_pools_a_second_model_is_refused() -> None:
    registry = Registry(10.0)
    registry.upsert(info("d0", "decode", OLD))
    with pytest.raises(KVIncompatible, match="weights"):
        registry.upsert(info("d1", "decode", NEW))


def test_pools_admit_listed_models_only_and_pair_within_a_pool() -> None:
    registry = Registry(10.0, pools={"m-old": 90, "m-new": 10})
    for iid, role, fp in [("d0", "decode", OLD), ("p0", "prefill", OLD), ("d1", "decode", NEW),
                          ("p1", "prefill", NEW), ("r0", "relay", None)]:
        registry.upsert(info(iid, role, fp))
    with pytest.raises(KVIncompatible, match="matches no entry"):
        registry.upsert(info("x", "decode", dataclasses.replace(NEW, model="m-other", weights="w3")))
    new = NEW.pool_key()
    assert [i.instance_id for i in registry.healthy("prefill", new)] == ["p1"]
    assert [i.instance_id for i in registry.healthy("relay", new)] == ["r0"]  # relays serve every pool
    with pytest.raises(InvalidRequest, match="not served"):
        registry.choose_pool("other-model", random.Random(0))
    assert registry.choose_pool("m-new", random.Random(0)) == new


def test_canary_weight_is_respected() -> None:
    registry = Registry(10.0, pools={"m-old": 90, "m-new": 10})
    registry.upsert(info("d0", "decode", OLD))
    registry.upsert(info("d1", "decode", NEW))
    rng = random.Random(7)
    draws = Counter(registry.choose_pool("", rng) for _ in range(4000))
    assert 0.08 < draws[NEW.pool_key()] / 4000 < 0.12
    registry.pools["m-new"] = 0  # the canary is stopped: nothing goes there
    assert {registry.choose_pool("", rng) for _ in range(200)} == {OLD.pool_key()}


def test_draining_instances_get_no_new_work() -> None:
    registry = Registry(10.0)
    registry.upsert(info("d0", "decode", OLD))
    registry.upsert(info("d1", "decode", OLD, draining=True))
    assert [i.instance_id for i in registry.healthy("decode")] == ["d0"]
    assert registry.mark_draining("d0") and registry.healthy("decode") == []
    assert pool_of(info("r", "relay", None)) == ""


def _blob(state: KVState, version: int = 0) -> bytes:
    writer = BlobWriter(BlobWriter.for_state(state).header, version)
    frames = [writer.header_frame(), *(f for layer in state.layers for f in writer.add_layer(layer))]
    return b"".join([*frames, *writer.finish(state.first_token)])


def test_mixed_format_versions_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A version-3 deployment (simulated) reads versions 2 and 3 and writes 2 while a version-2 reader is left;
    a version-2 reader refuses a version-3 blob with KV_BAD_FORMAT."""
    state = make_state()
    old_blob = _blob(state)
    for module in (fp_module, format_module):
        monkeypatch.setattr(module, "FORMAT_VERSION", 3)
        monkeypatch.setattr(module, "SUPPORTED_VERSIONS", frozenset({2, 3}))
    assert fp_module.negotiate_version([2, 3]) == 2 and fp_module.negotiate_version([3]) == 3
    assert decode_state(old_blob).seq_len == state.seq_len  # a new reader reads the previous format
    new_blob = _blob(state)
    assert new_blob[4:6] != old_blob[4:6]  # the version field of the header differs
    assert decode_state(new_blob).seq_len == state.seq_len
    assert _blob(state, 2)[:6] == old_blob[:6]  # negotiated down: written as version 2
    with pytest.raises(KVIncompatible):
        fp_module.negotiate_version([5])  # a reader two versions ahead
    monkeypatch.setattr(format_module, "SUPPORTED_VERSIONS", frozenset({2}))  # an old reader
    with pytest.raises(KVBadFormat, match="unknown KV format version 3"):
        decode_state(new_blob)
