"""The prefix cache in a whole ``prfaas up`` (relay mode, two tenants): a prompt sent again reuses its prefix on the
prefill instance (remote route) and on the decode instance (local route), answers the same, and another tenant's
identical prompt gets no hit; the metrics say so; the instances' prefix audit logs say where each tenant's
prefixes are, and record their end when the deployment stops."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prfaas.audit import verify
from prfaas.audit.prefix import prefix_report
from prfaas.audit.report import entries
from prfaas.engine import load_engine
from tests.conftest import random_prompt
from tests.services.deploy import deployment

KEYS = {tenant: f"{tenant}-key-" + "x" * 24 for tenant in ("acme", "globex")}
THRESHOLD = 64  # prompts of more tokens are prefilled remotely


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prefix-audit")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, audit_dir: Path) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("prefix")
    path = folder / "prfaas.yaml"
    path.write_text(yaml.safe_dump({"prefix_cache_mb": 64, "audit_log": str(audit_dir / "{instance}.jsonl"),
                                    "api_keys": [{"name": f"{t}-key", "key": k, "tenant": t}
                                                 for t, k in KEYS.items()]}))
    os.chmod(path, 0o600)  # it holds keys
    with deployment("tiny-llama", "relay", threshold=THRESHOLD, extra=("--config", str(path))) as (url, _):
        yield url
        _assert_no_kv_left(url)
    logs = sorted(audit_dir.glob("*-prefix.jsonl"))
    assert logs and all(verify(log).ok for log in logs)
    left = prefix_report(entries(list(logs)))["tenants"]
    assert left and not any(row["live"] for row in left.values())  # every cached prefix ended at shutdown


def _complete(url: str, tenant: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=_auth(tenant), timeout=120)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _auth(tenant: str = "acme") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def _prefix_metrics(url: str, role: str) -> dict[tuple[str, str], float]:
    """The prefix cache's counters of the instance of ``role``: (sample name, outcome label) → value."""
    instances = httpx.get(f"{url}/admin/instances", headers=_auth(), timeout=10).json()
    address = next(i["url"] for i in instances if i["role"] == role)
    text = httpx.get(f"{address}/metrics", timeout=10).text
    return {(s.name, s.labels.get("outcome", "")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("prfaas_prefix_cache_") and s.labels.get("role") == role}


def _decode_blocks(url: str) -> list[str]:
    """The held prefix blocks the router last heard of from the decode instance."""
    instances = httpx.get(f"{url}/admin/instances", headers=_auth(), timeout=10).json()
    return list(next(i for i in instances if i["role"] == "decode")["prefix_blocks"])


def _assert_no_kv_left(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stores = httpx.get(f"{url}/admin/kv", headers=_auth(), timeout=10).json()
        if stores and all(report["store"]["blobs"] == 0 for report in stores.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"KV left in the stores: {stores}")


@pytest.mark.parametrize(("length", "route", "role"), [(150, "remote", "prefill"), (50, "local", "decode")])
def test_a_repeated_prompt_reuses_its_prefix_for_its_tenant_only(deployed: str, length: int, route: str,
                                                                   role: str) -> None:
    prompt = random_prompt(length, seed=11)
    # the decode instance holds what it restored, so a remote prompt sent again whole would stay local (it lacks
    # under THRESHOLD tokens there): the remote case's repeat brings more than THRESHOLD new tokens, reuses the
    # prefill instance's prefix and ships only the suffix the decode instance lacks (docs/prefix-cache.md)
    longer = prompt + (random_prompt(THRESHOLD + 16, seed=13) if route == "remote" else [])
    held = len(_decode_blocks(deployed))
    first = _complete(deployed, "acme", prompt)
    if longer != prompt:  # the router learns what decode's restore stored from its next heartbeat: wait for it
        deadline = time.monotonic() + 30
        while len(_decode_blocks(deployed)) < held + length // 16:
            assert time.monotonic() < deadline, "the decode instance never reported the blocks it restored"
            time.sleep(0.05)
    again = _complete(deployed, "acme", longer)
    other = _complete(deployed, "globex", prompt)
    assert {r["prfaas"]["route"] for r in (first, again, other)} == {route}, first["prfaas"]
    texts = {r["choices"][0]["text"] for r in (first, other, *([again] if longer == prompt else []))}
    assert len(texts) == 1, texts  # greedy: a hit answers as a miss does
    reused = (length - 1) // 16 * 16  # every full block but the one holding the last token
    if longer != prompt:
        assert again["prfaas"]["kv_prefix_tokens"] == reused, again["prfaas"]
        engine = load_engine("tiny-llama")
        assert again["choices"][0]["text"] == engine.tokenizer.decode(engine.generate(longer, 6),
                                                                      skip_special_tokens=True)
    counted = _prefix_metrics(deployed, role)
    assert counted[("prfaas_prefix_cache_saved_tokens_total", "")] == reused  # only acme's second request hit
    assert counted[("prfaas_prefix_cache_lookups_total", "hit")] == 1
    assert counted[("prfaas_prefix_cache_lookups_total", "miss")] == 2
    assert counted[("prfaas_prefix_cache_prompt_tokens_total", "")] == 2 * length + len(longer)
    assert counted[("prfaas_prefix_cache_tokens", "")] >= 2 * reused  # both tenants' blocks are held


def test_the_prefix_audit_log_says_where_a_tenants_prefixes_live(deployed: str, audit_dir: Path) -> None:
    _complete(deployed, "acme", random_prompt(100, seed=12))  # remote: the prefill instance caches 96 tokens
    instances = httpx.get(f"{deployed}/admin/instances", headers=_auth(), timeout=10).json()
    prefill = next(i for i in instances if i["role"] == "prefill")
    report = prefix_report(entries(list(audit_dir.glob("*-prefix.jsonl"))), "acme")["tenants"]
    where = next(w for t, row in report.items() for i, w in row["live"].items()
                 if i == prefill["instance_id"])  # acme as a prefill instance salts it: <cluster>/acme
    assert where["datacenter"] == prefill["datacenter"] and where["tokens"] >= 96 and where["bytes"] > 0
