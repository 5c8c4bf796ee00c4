"""Prometheus against a real ``prfaas up``: the router's HTTP service discovery lists every process with its labels
behind the admin key, each role exports only its own series, and a real Prometheus (Debian's package) configured
by ``deploy/prometheus/prometheus.yml`` finds every target through the discovery and answers queries for TTFT and
transfer bytes with the values the processes export, both with API keys and with mutual TLS (``prfaas up --tls``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prfaas.security import certs, local
from tests.services.deploy import deployment, free_port, tls_dir

MODEL = "tiny-llama"
KEY = "monitoring-key-" + "x" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ROLES = {"router", "relay", "prefill", "decode"}
PRFAAS_UP_DEFAULT = "http://127.0.0.1:8000"  # prfaas up's router
# Series a role must not export: another role's. The router's view of transfers (exposed time) is its own.
FOREIGN = {
    "router": ("prfaas_store_", "prfaas_transfer_seconds", "prfaas_transfer_bytes", "prfaas_transfer_blob",
               "prfaas_transfer_payload", "prfaas_transfer_inflight", "prfaas_transfer_retries", "prfaas_prefill_",
               "prfaas_tenant_kv_byte_seconds"),
    "decode": ("prfaas_router_", "prfaas_request_", "prfaas_registry_", "prfaas_instance_", "prfaas_store_",
               "prfaas_tenant_", "prfaas_prefill_", "prfaas_transfer_exposed"),
    "prefill": ("prfaas_router_", "prfaas_request_", "prfaas_registry_", "prfaas_transfer_seconds",
                "prfaas_transfer_bytes", "prfaas_transfer_exposed"),
    "relay": ("prfaas_router_", "prfaas_request_", "prfaas_registry_", "prfaas_transfer_", "prfaas_prefill_"),
}
OWN = {"router": "prfaas_request_ttft_seconds", "decode": "prfaas_transfer_bytes", "prefill": "prfaas_prefill_seconds",
       "relay": "prfaas_store_accesses"}


@dataclass
class Deployed:
    """A running ``prfaas up``, the client that reaches every process of it, and what Prometheus needs to."""

    url: str
    client: httpx.Client
    sd: dict[str, Any]  # settings of the discovery in http_sd_configs (beyond url and refresh_interval)
    scrape: dict[str, Any] = field(default_factory=dict)  # settings of the scrape job (its tls_config)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    """Relay mode with an API key: the discovery needs it, the scrapes do not."""
    folder = tmp_path_factory.mktemp("prometheus-prfaas")
    path, key_file = folder / "prfaas.yaml", folder / "prfaas-api-key"
    path.write_text(yaml.safe_dump({"api_keys": [{"name": "monitoring", "key": KEY}]}))
    key_file.write_text(KEY)
    for secret in (path, key_file):
        os.chmod(secret, 0o600)  # files holding keys are readable by their owner only
    with deployment(MODEL, "relay", threshold=0, extra=("--config", str(path))) as (url, _), \
            httpx.Client(headers=AUTH, timeout=120) as client:
        yield Deployed(url, client, {"authorization": {"type": "Bearer", "credentials_file": str(key_file)}})
        _assert_no_kv_left(url, client)


@pytest.fixture(scope="module")
def deployed_tls() -> Iterator[Deployed]:
    """``prfaas up --tls`` (mutual TLS required on every instance): Prometheus trusts the CA for the discovery and
    presents a certificate of that CA to scrape, as docs/operations.md says."""
    with deployment(MODEL, "relay", threshold=0, extra=("--tls",)) as (url, proc):
        root = tls_dir(proc)
        certs.issue(root, "router", "prometheus")  # Prometheus's own certificate (its key stays in that folder)
        tls = {"ca_file": str(root / "ca.pem"), "cert_file": str(root / "prometheus.pem"),
               "key_file": str(root / "prometheus.key")}
        verify = local.ca_client_context(tls["ca_file"])
        verify.load_cert_chain(tls["cert_file"], tls["key_file"])
        with httpx.Client(verify=verify, timeout=120) as client:
            yield Deployed(url, client, {"tls_config": {"ca_file": tls["ca_file"]}}, {"tls_config": tls})
            _assert_no_kv_left(url, client)


def _assert_no_kv_left(url: str, client: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stores = client.get(f"{url}/admin/kv").json()
        if stores and all(report["store"]["blobs"] == 0 for report in stores.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"KV left in the stores: {stores}")


def _remote_requests(d: Deployed, n: int) -> None:
    for i in range(n):
        body = {"model": MODEL, "prompt": list(range(100 + i, 160 + i)), "max_tokens": 4, "temperature": 0}
        reply = d.client.post(f"{d.url}/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["prfaas"]["route"] == "remote", reply.json()["prfaas"]


def _targets(d: Deployed) -> list[dict[str, Any]]:
    reply = d.client.get(f"{d.url}/admin/prometheus/targets")
    assert reply.status_code == 200, reply.text
    return list(reply.json())


def _families(d: Deployed, target: dict[str, Any]) -> dict[str, float]:
    """Each family the target exports, with the sum of its ``_total``/``_count`` samples (or its value)."""
    labels = target["labels"]
    reply = d.client.get(f"{labels['__scheme__']}://{target['targets'][0]}{labels['__metrics_path__']}")
    assert reply.status_code == 200, reply.text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(reply.text):
        counted = [s.value for s in family.samples if s.name.endswith(("_total", "_count"))]
        out[family.name] = sum(counted) if counted else sum(s.value for s in family.samples)
    return out


def test_discovery_lists_every_process_behind_the_admin_key(deployed: Deployed) -> None:
    refused = httpx.get(f"{deployed.url}/admin/prometheus/targets", timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
    groups = _targets(deployed)
    by_id = {g["labels"]["prfaas_instance_id"]: g for g in groups}
    assert set(by_id) == {"router", "relay-0", "prefill-0", "decode-0"}, groups
    assert by_id["router"]["targets"] == [deployed.url.removeprefix("http://")]
    assert {g["labels"]["prfaas_role"] for g in groups} == ROLES
    assert by_id["prefill-0"]["labels"]["prfaas_datacenter"] == "dc-a"
    assert by_id["decode-0"]["labels"]["prfaas_datacenter"] == "dc-b"
    assert by_id["relay-0"]["labels"]["prfaas_datacenter"] == "dc-b"
    registered = {i["instance_id"]: i["url"] for i in deployed.client.get(f"{deployed.url}/admin/instances").json()}
    for instance_id, url in registered.items():
        assert url == f"http://{by_id[instance_id]['targets'][0]}"
    assert all(len(g["targets"]) == 1 and g["labels"]["__scheme__"] == "http" for g in groups)


def test_each_role_exports_only_its_own_series(deployed: Deployed) -> None:
    _remote_requests(deployed, 2)
    for target in _targets(deployed):
        role = target["labels"]["prfaas_role"]
        families = _families(deployed, target)
        foreign = sorted(name for name in families if name.startswith(FOREIGN[role]))
        assert not foreign, f"{role} exports other roles' series: {foreign}"
        assert families.get(OWN[role], 0) > 0, (role, OWN[role], families)


needs_prometheus = pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK), reason="prometheus missing (Debian "
                                      "package prometheus; scripts/install-system-deps.sh installs it)")


@needs_prometheus
def test_a_real_prometheus_scrapes_every_role_through_the_discovery(deployed: Deployed, tmp_path: Path) -> None:
    _scraped_through_prometheus(deployed, tmp_path)


@needs_prometheus
def test_a_real_prometheus_scrapes_a_mutual_tls_deployment(deployed_tls: Deployed, tmp_path: Path) -> None:
    assert {g["labels"]["__scheme__"] for g in _targets(deployed_tls)} == {"https"}
    _scraped_through_prometheus(deployed_tls, tmp_path)


def _scraped_through_prometheus(d: Deployed, folder: Path) -> None:
    """Every target found and up; after three remote requests, TTFT and transfer bytes read through Prometheus's
    query API equal what the router and decode export."""
    with prometheus(folder, d) as api:
        up = _wait(lambda: _active(api), lambda t: len(t) == 4 and all(x["health"] == "up" for x in t.values()),
                   "every target up")
        assert set(up) == {"router", "relay-0", "prefill-0", "decode-0"}, up
        assert {t["labels"]["prfaas_role"] for t in up.values()} == ROLES
        _remote_requests(d, 3)
        groups = {g["labels"]["prfaas_instance_id"]: g for g in _targets(d)}
        ttft = _families(d, groups["router"])["prfaas_request_ttft_seconds"]
        moved = _families(d, groups["decode-0"])["prfaas_transfer_bytes"]
        assert ttft >= 3 and moved > 0, (ttft, moved)
        seen = _wait(lambda: _query(api, "sum(prfaas_request_ttft_seconds_count)"),
                     lambda r: bool(r) and float(r[0]["value"][1]) >= ttft, "the TTFT samples")
        assert float(seen[0]["value"][1]) == ttft
        moved_seen = _wait(lambda: _query(api, "prfaas_transfer_bytes_total"),
                           lambda r: bool(r) and float(r[0]["value"][1]) >= moved, "the transfer bytes")
        assert len(moved_seen) == 1, moved_seen  # decode's own: the router no longer exports a zero series
        assert float(moved_seen[0]["value"][1]) == moved
        assert moved_seen[0]["metric"]["instance"] == "decode-0"
        assert moved_seen[0]["metric"]["prfaas_role"] == "decode"
        assert moved_seen[0]["metric"]["prfaas_datacenter"] == "dc-b"


class PrometheusApi:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        reply = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["status"] == "success", body
        return body["data"]


def _active(api: PrometheusApi) -> dict[str, dict[str, Any]]:
    return {t["labels"]["instance"]: t for t in api.get("/api/v1/targets", state="active")["activeTargets"]}


def _query(api: PrometheusApi, expr: str) -> list[dict[str, Any]]:
    return list(api.get("/api/v1/query", query=expr)["result"])


def _wait(read: Any, done: Any, what: str, timeout_s: float = 60.0) -> Any:
    deadline, value = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        value = read()
        if done(value):
            return value
        time.sleep(0.5)
    raise AssertionError(f"Prometheus did not show {what} within {timeout_s:.0f} s: {value}")


def _config(folder: Path, d: Deployed) -> Path:
    """deploy/prometheus/prometheus.yml pointed at this router, with the deployment's credentials and a 1 s
    interval."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / name) for name in config["rule_files"]]
    (job,) = config["scrape_configs"]
    (sd,) = job["http_sd_configs"]
    assert sd["url"].startswith(PRFAAS_UP_DEFAULT + "/"), sd["url"]  # the file works as it is for `prfaas up`
    sd.update(url=d.url + sd["url"].removeprefix(PRFAAS_UP_DEFAULT), refresh_interval="1s", **d.sd)
    job.update(d.scrape)
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def prometheus(folder: Path, d: Deployed) -> Iterator[PrometheusApi]:
    """``prometheus`` on a free loopback port with its own storage in ``folder``; stopped and waited for at exit."""
    port, log_path = free_port(), folder / "prometheus.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={_config(folder, d)}",
                                 f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    api = PrometheusApi(f"http://127.0.0.1:{port}")
    try:
        _wait(lambda: _ready(api, proc, log_path), bool, "itself ready")
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready(api: PrometheusApi, proc: subprocess.Popen[bytes], log_path: Path) -> bool:
    assert proc.poll() is None, f"prometheus exited: {log_path.read_text()[-3000:]}"
    try:
        return httpx.get(f"{api.url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
