"""Three tenants through a whole ``prfaas up`` (relay mode, KV sealed at rest, audit logs on): a pinned tenant is
never offloaded and is told why, a tenant's codec override shapes its blobs, a redacting tenant's identifiers never
reach the model, and the metering in the metrics equals the sums over the audit logs (``prfaas admin usage``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.services.deploy import deployment

KEYS = {tenant: f"{tenant}-key-" + "x" * 24 for tenant in ("acme", "beta", "gamma")}
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 8
EMAIL = "Write to jane.doe@example.com about 10.20.30.40. "
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("tenancy")
    subprocess.run([sys.executable, "-m", "prfaas", "admin", "store-key", str(folder / "store.key")], check=True)
    config = {
        "api_keys": [{"name": f"{t}-key", "key": k, "tenant": t} for t, k in KEYS.items()],
        "tenants": {"acme": {"allowed_datacenters": ["dc-b"]}, "beta": {"kv_ttl_seconds": 60, "kv_codec": "int8"},
                    "gamma": {"redact": "mask_identifiers", "rate_limit_qps": 50}},
        "store_key_file": str(folder / "store.key"), "audit_log": str(folder / "audit-{instance}.log"),
    }
    path = folder / "prfaas.yaml"
    path.write_text(yaml.safe_dump(config))
    os.chmod(path, 0o600)
    with deployment("tiny-llama", "relay", threshold=32, extra=("--config", str(path))) as (url, proc):
        yield url, proc, folder


def _complete(url: str, tenant: str, prompt: str, stream: bool = False) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0)
    if not stream:
        out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return {**out.model_extra["prfaas"], "usage": out.usage.model_dump()}
    extension: dict[str, Any] = {}
    for chunk in client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True):
        extension = (chunk.model_extra or {}).get("prfaas", extension)
    return extension


def _metrics(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", headers=headers or {}).text
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("prfaas_tenant_") and sample.name.endswith("_total"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_three_tenants_policy_redaction_and_metering(deployed: Any) -> None:
    url, proc, folder = deployed
    auth = {"Authorization": f"Bearer {KEYS['beta']}"}
    instances = httpx.get(f"{url}/admin/instances", headers=auth).json()
    decode = next(i["url"] for i in instances if i["role"] == "decode")
    relay = next(i["url"] for i in instances if i["role"] == "relay")

    results = {t: [_complete(url, t, LONG + t, stream=s) for s in (False, True)] for t in KEYS}
    results["short"] = [_complete(url, t, "Hi", stream=False) for t in KEYS]
    masked = _complete(url, "gamma", EMAIL + LONG)

    assert all(r["route"] == "local" and r["reason"].startswith("tenant acme's KV may only be held in dc-b")
               for r in results["acme"]), results["acme"]
    assert all(r["route"] == "remote" and r["tenant"] == t for t in ("beta", "gamma") for r in results[t])
    assert all(r["route"] == "local" for r in results["short"])
    assert results["beta"][0]["kv_bytes"] < results["gamma"][0]["kv_bytes"] / 2  # beta's codec override: int8
    # redaction happened before tokenisation: the prompt counted is the masked one
    ids = httpx.post(f"{decode}/tokenize", json={"prompt": "Write to [EMAIL] about [IP]. " + LONG}).json()
    assert masked["route"] == "remote" and masked["usage"]["prompt_tokens"] == len(ids["token_ids"])

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-" + "y" * 20, max_retries=0).completions.create(
            model="tiny-llama", prompt="x", max_tokens=1)
    router_metrics, relay_metrics = _metrics(url, auth), _metrics(relay)
    proc.terminate()
    assert proc.wait(timeout=60) == 0  # logs closed cleanly before they are summed

    logs = sorted(str(p) for p in Path(folder).glob("audit-*.log"))
    assert any(p.endswith("audit-router-usage.log") for p in logs) and any("relay" in p for p in logs)
    report = json.loads(subprocess.run([sys.executable, "-m", "prfaas", "admin", "usage", *logs, "--day", "all",
                                        "--json"], check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    print("\nusage report:", json.dumps(report["tenants"], sort_keys=True))
    _assert_metering_equals_logs(report["tenants"], router_metrics, relay_metrics)
    assert report["tenants"]["acme"]["total"]["offload_fraction"] == 0.0
    assert report["tenants"]["acme"]["kv_byte_seconds"] == {}  # its KV was never held by the relay
    assert report["tenants"]["beta"]["total"]["offload_fraction"] == pytest.approx(2 / 3, abs=1e-3)
    assert set(report["tenants"]["beta"]["pairs"]) == {"dc-a->dc-b", "dc-b->dc-b"}

    relay_log = next(p for p in logs if "relay" in p)
    deletions = [e for e in map(json.loads, Path(relay_log).read_text().splitlines()) if e["kind"] == "deletion"]
    assert deletions and all(e["key_destroyed"] and e["tenant"] in ("beta", "gamma") for e in deletions)
    assert all(e["reason"] == "released" for e in deletions)
    text = "".join(Path(p).read_text() for p in logs)
    assert "jane.doe" not in text and "quick brown fox" not in text and "x" * 24 not in text


def _assert_metering_equals_logs(tenants: dict[str, Any], router: dict, relay: dict) -> None:
    sums: dict[tuple[str, str, str, str], float] = {}
    for (name, labels), value in router.items():
        d = dict(labels)
        kind = name.removeprefix("prfaas_tenant_").removesuffix("_total")
        key = (d["tenant"], f"{d['src_dc']}->{d['dst_dc']}", kind, "")
        sums[key] = sums.get(key, 0.0) + value
    for tenant, usage in tenants.items():
        for pair, row in usage["pairs"].items():
            assert sums.pop((tenant, pair, "requests", ""), 0) == row["requests"], (tenant, pair)
            assert sums.pop((tenant, pair, "prompt_tokens", ""), 0) == row["prompt_tokens"], (tenant, pair)
            assert sums.pop((tenant, pair, "output_tokens", ""), 0) == row["output_tokens"], (tenant, pair)
            assert sums.pop((tenant, pair, "kv_wan_bytes", ""), 0) == row["kv_wan_bytes"], (tenant, pair)
        held = {dict(lb)["datacenter"]: v for (name, lb), v in relay.items()
                if name == "prfaas_tenant_kv_byte_seconds_total" and dict(lb)["tenant"] == tenant}
        assert held == pytest.approx(usage["kv_byte_seconds"], rel=1e-9), tenant
    assert not {k: v for k, v in sums.items() if v}, f"metered but not in the logs: {sums}"
    assert {t for t in tenants} == {"acme", "beta", "gamma"}
    assert sum(u["total"]["kv_wan_bytes"] for u in tenants.values()) > 0
