"""Audit logs: a store's accesses and deletions chained in a file, tampering detected, a restarted store continues
the chain and settles what its predecessor never recorded, and the CLI answers "was blob X deleted, when, why"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prfaas.audit import AuditLog, verify
from prfaas.audit.report import blob_story, entries, summary
from prfaas.cli import app
from prfaas.store import BlobStore, accessing
from tests.transfer.helpers import assert_clean, blob_frames, fill, make_state, run

MiB = 1 << 20


def audited_store(path: Path, name: str = "relay-0") -> tuple[BlobStore, AuditLog]:
    log = AuditLog(path, name)
    store = BlobStore(64 * MiB, 120, on_delete=log.deletion, on_access=log.access, owner=name)
    log.opened(backend="memory")
    log.settle({b.kv_id for b in store.live()}, store.ttl_s)
    return store, log


def read_all(store: BlobStore, kv_id: str) -> list[bytes]:
    async def go() -> list[bytes]:
        return [f async for f in store.frames(kv_id)]

    return run(go)


def lifecycle(path: Path) -> list[str]:
    store, log = audited_store(path)
    ids = []
    for seed in range(3):
        kv_id, frames = blob_frames(make_state(layers=1, tokens=32, seed=seed))
        with accessing(who="prefill-0@127.0.0.1", purpose=f"req-{seed}"):
            fill(store, kv_id, frames)
        ids.append(kv_id)
    with accessing(who="decode-0@127.0.0.1", purpose="req-0"):
        read_all(store, ids[0])
        store.release(ids[0])
        with pytest.raises(Exception, match="released"):
            read_all(store, ids[0])  # refused reads are on record too
    store.abort(ids[1])
    store.close()
    log.close()
    assert_clean(store)
    return ids


def test_every_access_and_deletion_is_chained(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    ids = lifecycle(path)
    verdict = verify(path)
    assert verdict.ok, verdict.error
    assert verdict.created == 3 and dict(verdict.ended) == {"released": 1, "aborted": 1, "shutdown": 1}
    assert verdict.open_blobs == [] and verdict.clean_close and verdict.sessions == 1
    story = blob_story(entries([path]), ids[0])
    assert story["deleted"] and story["deletion"]["reason"] == "released"
    assert story["deletion"]["checksum"].startswith("xxh64:")
    actions = [(a["action"], a["who"], a["outcome"]) for a in story["accesses"]]
    assert actions == [("create", "prefill-0@127.0.0.1", "ok"), ("finish", "prefill-0@127.0.0.1", "ok"),
                       ("read", "decode-0@127.0.0.1", "ok"), ("release", "decode-0@127.0.0.1", "ok"),
                       ("read", "decode-0@127.0.0.1", "KV_NOT_FOUND")]
    assert story["accesses"][0]["purpose"] == "req-0"
    assert summary(entries([path]))["never_ended"] == []


def test_no_prompt_content_in_the_log(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lifecycle(path)
    for line in path.read_text().splitlines():
        keys = set(json.loads(line))
        assert keys <= {"seq", "kind", "store", "prev", "hash", "at_ms", "backend", "action", "kv_id", "who",
                        "purpose", "bytes", "outcome", "reason", "chunks", "checksum", "created_ms", "deleted_ms",
                        "detail", "created", "deleted", "tenant", "key_destroyed", "datacenter"}, keys


@pytest.mark.parametrize("tamper", ["edit", "delete", "swap", "insert", "garbage"])
def test_tampering_is_detected(tmp_path: Path, tamper: str) -> None:
    path = tmp_path / "audit.jsonl"
    lifecycle(path)
    lines = path.read_text().splitlines()
    if tamper == "edit":
        lines[5] = lines[5].replace('"ok"', '"KV_NOT_FOUND"') if '"ok"' in lines[5] else lines[5].replace("1", "2")
    elif tamper == "delete":
        del lines[4]
    elif tamper == "swap":
        lines[3], lines[4] = lines[4], lines[3]
    elif tamper == "insert":
        lines.insert(2, lines[2])
    else:
        lines[6] = lines[6][:20]
    path.write_text("\n".join(lines) + "\n")
    verdict = verify(path)
    assert not verdict.ok and verdict.error.startswith("line ")


def test_a_restarted_store_continues_the_chain_and_settles_lost_blobs(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    store, log = audited_store(path)
    kv_id, frames = blob_frames(make_state(layers=1, tokens=32))
    fill(store, kv_id, frames)
    log.chain.close()  # the process is killed: no close entry, the blob never ended on record
    assert verify(path).open_blobs == [kv_id]
    store2, log2 = audited_store(path)  # a new process, an empty memory store
    store2.close()
    log2.close()
    verdict = verify(path)
    assert verdict.ok and verdict.sessions == 2 and verdict.open_blobs == [] and verdict.clean_close
    story = blob_story(entries([path]), kv_id)
    assert story["deletion"]["reason"] == "shutdown" and "ended without recording" in story["deletion"]["detail"]


def test_cli_verify_and_report(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    ids = lifecycle(path)
    runner = CliRunner()
    out = runner.invoke(app, ["audit", "verify", str(path), "--json"])
    assert out.exit_code == 0, out.output
    assert "OK: the chain is intact" in out.output
    assert json.loads(out.output.strip().splitlines()[-1])["ok"] is True
    out = runner.invoke(app, ["audit", "report", str(path), "--kv-id", ids[0]])
    assert out.exit_code == 0 and "reason released" in out.output and "decode-0@127.0.0.1" in out.output
    out = runner.invoke(app, ["audit", "report", str(path), "--json"])
    assert json.loads(out.output.strip().splitlines()[-1])["ended_by_reason"]["shutdown"] == 1
    path.write_text(path.read_text().replace('"released"', '"expired"'))
    out = runner.invoke(app, ["audit", "verify", str(path)])
    assert out.exit_code == 1 and "BROKEN" in out.output
