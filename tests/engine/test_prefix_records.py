"""Cached prefixes are tenant data: they expire after ``prefix_cache_ttl_s`` (never served after), every store and
deletion (evicted, expired, tenant deleted, shutdown) is recorded in the instance's prefix audit log without
token ids or hashes, a tenant whose residency forbids the instance's datacenter gets nothing cached there, and
``prfaas audit report --tenant`` says where a tenant's prefixes live and when and why they were deleted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from typer.testing import CliRunner

from prfaas.audit import verify
from prfaas.audit.prefix import CRASHED, PrefixAuditLog, prefix_log_path
from prfaas.cli import app
from prfaas.config import from_dict
from prfaas.engine.prefix_cache import PrefixCache
from prfaas.engine.prefix_prefill import PrefixPrefill
from prfaas.engine.prefix_records import PrefixLifecycle
from prfaas.kv import Fingerprint, KVState, LayerState
from prfaas.kv.prefix import block_hashes, prefix_salt, summary_key
from prfaas.records import EVICTED, EXPIRED, PREFIX_DELETED, PREFIX_STORED, SHUTDOWN, TENANT_DELETED, PrefixRecord
from tests.clock import Clock
from tests.conftest import random_prompt

BLOCK = 4
PAGE_BYTES = 2 * 2 * BLOCK * 4 * 4  # keys + values, (1, 2, BLOCK, 4) float32
FINGERPRINT = Fingerprint(model="m", arch="llama", weights="w", tokenizer="t", dtype="float32", max_seq_len=64)


def cache_with(records: list[PrefixRecord], ttl_s: float = 0.0, clock: Clock | None = None,
               budget_blocks: int = 16, allows: Any = lambda tenant: True) -> PrefixCache:
    lifecycle = PrefixLifecycle(ttl_s, allows, records.append, clock=clock or Clock())
    return PrefixCache(budget_blocks * PAGE_BYTES, BLOCK, lifecycle)


def keep(cache: PrefixCache, ids: list[int], tenant: str = "acme") -> int:
    """Look ``ids`` up, store its blocks up to its last boundary, release; the tokens the lookup reused."""
    hit = cache.lookup(block_hashes(ids, prefix_salt(FINGERPRINT, tenant), BLOCK), len(ids), tenant)
    cache.store(hit, kv((len(ids) - 1) // BLOCK * BLOCK))
    cache.release(hit)
    return hit.length


def kv(seq_len: int) -> KVState:
    def zeros() -> np.ndarray:
        return np.zeros((1, 2, seq_len, 4), dtype=np.float32)

    layer = LayerState(index=0, kind="full_attention", grows=True, tensors={"keys": zeros(), "values": zeros()},
                       attrs={"is_initialized": True})
    return KVState(fingerprint=FINGERPRINT, seq_len=seq_len, layers=[layer])


def test_a_prefix_expires_after_its_ttl_and_is_never_served_after() -> None:
    clock, records = Clock(), list[PrefixRecord]()
    cache = cache_with(records, ttl_s=60, clock=clock)
    ids = list(range(100, 113))  # 3 full blocks below the last token
    keep(cache, ids)
    clock.now = 59.9
    assert keep(cache, ids) == 12  # within its TTL: a hit, which does not extend it
    clock.now = 60.0
    assert keep(cache, ids) == 0  # expired: dropped before the lookup, then stored again as a new entry
    stored = [r for r in records if r.kind == PREFIX_STORED]
    deleted = [r for r in records if r.kind == PREFIX_DELETED]
    assert [(r.tokens, r.bytes, r.blocks) for r in stored] == [(12, 3 * PAGE_BYTES, 3)] * 2
    assert [(r.entry, r.reason, r.tokens, r.bytes, r.left_tokens) for r in deleted] == [
        (stored[0].entry, EXPIRED, 12, 3 * PAGE_BYTES, 0)]
    assert stored[0].entry != stored[1].entry and len(cache) == 3 and cache.nbytes == 3 * PAGE_BYTES


def test_a_held_prefix_outlives_its_ttl_only_until_its_prompt_ends() -> None:
    clock, records = Clock(), list[PrefixRecord]()
    cache = cache_with(records, ttl_s=10, clock=clock)
    ids = list(range(13))
    keep(cache, ids)
    held = cache.lookup(block_hashes(ids, prefix_salt(FINGERPRINT, "acme"), BLOCK), len(ids), "acme")
    clock.now = 11
    cache.expire()
    assert len(cache) == 3  # pinned by the prompt in progress: its restore reads them
    cache.release(held)
    cache.expire()
    assert len(cache) == 0 and cache.nbytes == 0
    assert [r.reason for r in records if r.kind == PREFIX_DELETED] == [EXPIRED]


def test_records_of_stores_and_evictions_say_how_much_never_what() -> None:
    records: list[PrefixRecord] = []
    cache = cache_with(records, budget_blocks=4)
    first, second = list(range(200, 213)), list(range(300, 313))  # 3 blocks each; room for 4
    keep(cache, first)
    keep(cache, second)  # evicts two of the first prompt's blocks, leaf first
    assert [(r.kind, r.reason, r.tokens, r.left_tokens) for r in records] == [
        (PREFIX_STORED, "", 12, 0), (PREFIX_DELETED, EVICTED, 8, 4), (PREFIX_STORED, "", 12, 0)]  # in order
    assert records[0].entry == records[1].entry and records[0].tenant == "acme"
    hashes = {summary_key(k) for ids in (first, second)
              for k in block_hashes(ids, prefix_salt(FINGERPRINT, "acme"), BLOCK)}
    text = json.dumps([r.to_dict() for r in records])
    assert not any(h in text for h in hashes)
    assert all(set(r.to_dict()) == {"kind", "entry", "tenant", "tokens", "bytes", "blocks", "created_ms", "at_ms",
                                    "reason", "left_tokens"} for r in records)  # sizes and times, no token ids


def test_a_deleted_tenant_loses_its_prefixes_and_no_other() -> None:
    records: list[PrefixRecord] = []
    cache = cache_with(records)
    ids = list(range(13))
    keep(cache, ids, "acme")
    keep(cache, ids, "beta")
    cache.drop_tenant("acme")
    assert keep(cache, ids, "acme") == 0 and keep(cache, ids, "beta") == 12
    gone = [r for r in records if r.kind == PREFIX_DELETED]
    assert [(r.tenant, r.reason, r.tokens) for r in gone] == [("acme", TENANT_DELETED, 12)]


def test_residency_that_forbids_this_datacenter_caches_nothing(tmp_path: Path) -> None:
    config = from_dict({"datacenter": "dc-a", "audit_log": str(tmp_path / "{instance}.jsonl"), "tenants": {
        "eu": {"allowed_datacenters": ["dc-b"]}, "anywhere": {}}})
    lifecycle = PrefixLifecycle.configured(config, "prefill-0")
    cache = PrefixCache(16 * PAGE_BYTES, BLOCK, lifecycle)
    ids = list(range(13))
    for tenant in ("eu", "c1/eu"):  # its own name, or as a prefill pool salts it (<cluster>/<tenant>)
        keep(cache, ids, tenant)
        assert keep(cache, ids, tenant) == 0
    assert len(cache) == 0
    keep(cache, ids, "c1/anywhere")
    assert keep(cache, ids, "c1/anywhere") == 12
    lifecycle.close()
    kinds = [e["kind"] for e in map(json.loads, Path(prefix_log_path(config.store.audit_log, "prefill-0"))
                                    .read_text().splitlines())]
    assert kinds == [PREFIX_STORED, PREFIX_DELETED]  # the allowed tenant only, ended at shutdown


def test_the_audit_report_says_where_a_tenants_prefixes_live_and_when_they_went(engines: Any,
                                                                               tmp_path: Path) -> None:
    """The engine path (a real model's prefill through the cache) writes the log the CLI reads."""
    clock = Clock(0)
    config = from_dict({"datacenter": "dc-a", "audit_log": str(tmp_path / "{instance}.jsonl"),
                        "prefix_cache_ttl_s": 30})
    path = prefix_log_path(config.store.audit_log, "decode-0")
    lifecycle = PrefixLifecycle.configured(config, "decode-0", clock)
    prefix = PrefixPrefill(engines("tiny-llama"), 64 << 20, "test", lifecycle=lifecycle)
    for tenant, seed in (("acme", 1), ("beta", 2), ("acme", 3)):
        *_, last = prefix.chunks(random_prompt(40 + seed, seed=seed), tenant, 64)
        assert last is not None
        clock.now += 20  # the first prompt is 40 s old at the last one's lookup: expired
    report = _report(path, "acme")
    acme = report["tenants"]["acme"]
    assert acme["live"] == {"decode-0": {"datacenter": "dc-a", "tokens": 32, "bytes": acme["live"]["decode-0"]
                                         ["bytes"], "entries": 1}}
    assert [(d["reason"], d["tokens"], d["instance"], d["datacenter"]) for d in acme["deletions"]] == [
        (EXPIRED, 32, "decode-0", "dc-a")]
    lifecycle.close()  # shutdown: what is still cached is deleted with the process
    after = _report(path, "")
    assert all(not row["live"] for row in after["tenants"].values())
    assert [d["reason"] for d in after["tenants"]["acme"]["deletions"]] == [EXPIRED, SHUTDOWN]
    assert verify(path).ok
    text = CliRunner().invoke(app, ["audit", "report", path, "--tenant", "acme"]).output
    assert "cached nowhere" in text and "decode-0 (dc-a), expired: 32 tokens" in text and "shutdown" in text


def test_a_reopened_log_records_the_end_of_what_a_killed_process_held(tmp_path: Path) -> None:
    path = tmp_path / "decode-0-prefix.jsonl"
    log = PrefixAuditLog(path, "decode-0", "dc-b")
    log.record(PrefixRecord(PREFIX_STORED, "px-1", "acme", 32, 4096, 2, 1000, 1000))
    log.record(PrefixRecord(PREFIX_DELETED, "px-1", "acme", 16, 2048, 1, 1000, 2000, EVICTED, 16))
    log.chain.close()  # killed: the rest of px-1 was never recorded as deleted
    PrefixAuditLog(path, "decode-0", "dc-b").close()
    deletions = _report(str(path), "acme")["tenants"]["acme"]["deletions"]
    assert [(d["reason"], d["tokens"], d.get("detail")) for d in deletions] == [
        (EVICTED, 16, None), (SHUTDOWN, 16, CRASHED)]
    assert verify(path).ok


def _report(path: str, tenant: str) -> dict[str, Any]:
    args = ["audit", "report", path, "--prefixes", "--json"] + (["--tenant", tenant] if tenant else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.output.strip().splitlines()[-1])
    return report
