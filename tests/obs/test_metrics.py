"""Each role renders only its own series (``prfaas.obs.metrics.served``); the discovery body's shape. The same is
checked on a real ``prfaas up`` and a real Prometheus by tests/services/test_prometheus.py."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prfaas.messages import InstanceInfo
from prfaas.obs import discovery, metrics

ROLES = ("router", "prefill", "decode", "relay")


def _rendered(role: str, engine: str = "prfaas") -> set[str]:
    text = metrics.render(metrics.served(role, engine)).decode()
    # the text parser reads an unlabelled counter's or histogram's `_created` sample as a family of its own
    return {family.name.removesuffix("_created") for family in text_string_to_metric_families(text)}


def test_every_metric_is_rendered_by_some_role_and_no_family_twice() -> None:
    assert set().union(*(_rendered(role) for role in ROLES)) == metrics.names()
    for role in ROLES:
        text = metrics.render(metrics.served(role)).decode()
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
        assert len(types) == len(set(types)), role


def test_the_router_renders_no_transfer_or_store_series_and_decode_no_router_ones() -> None:
    router = _rendered("router")
    assert "prfaas_request_ttft_seconds" in router and "prfaas_registry_instances" in router
    assert not {n for n in router if n.startswith("prfaas_store_")}
    assert {n for n in router if n.startswith("prfaas_transfer_")} == {"prfaas_transfer_exposed_seconds"}
    decode = _rendered("decode")
    assert {"prfaas_transfer_bytes", "prfaas_transfer_seconds", "prfaas_transfer_blob_seconds"} <= decode
    assert not {n for n in decode if n.startswith(("prfaas_router_", "prfaas_request_", "prfaas_registry_",
                                                    "prfaas_store_", "prfaas_prefill_"))}
    assert {n for n in _rendered("relay")} == {n for n in metrics.names() if n.startswith("prfaas_store_")} | {
        "prfaas_tenant_kv_byte_seconds"}
    assert "prfaas_prefill_seconds" in _rendered("prefill") and "prfaas_store_live_bytes" in _rendered("prefill")


def test_an_instance_in_front_of_vllm_renders_nothing_of_its_own() -> None:
    assert metrics.served("prefill", "vllm") == metrics.served("decode", "vllm") == ()
    assert metrics.served("relay", "vllm") == metrics.served("relay")
    with pytest.raises(ValueError, match="unknown role"):
        metrics.served("monitor")


def test_discovery_targets_carry_role_instance_and_datacenter() -> None:
    router = discovery.Target(discovery.address("::1", 8000), "https", "router", "router")
    relay = InstanceInfo(instance_id="relay-0", role="relay", url="https://10.0.0.5:40123", datacenter="dc-b")
    groups = discovery.target_groups(router, [relay])
    assert groups == [
        {"targets": ["[::1]:8000"], "labels": {"__scheme__": "https", "__metrics_path__": "/metrics",
                                               "prfaas_role": "router", "prfaas_instance_id": "router"}},
        {"targets": ["10.0.0.5:40123"], "labels": {"__scheme__": "https", "__metrics_path__": "/metrics",
                                                   "prfaas_role": "relay", "prfaas_instance_id": "relay-0",
                                                   "prfaas_datacenter": "dc-b"}}]
