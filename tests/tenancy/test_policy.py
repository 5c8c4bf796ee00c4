"""Tenant policies: limits refused at load, residency and prompt-crossing narrowing the scheduler's choice."""

from __future__ import annotations

import pytest

from prfaas.config import from_dict
from prfaas.errors import InvalidRequest, KVUnavailable
from prfaas.messages import InstanceInfo
from prfaas.scheduler import Scheduler
from prfaas.security.apikeys import parse_keys
from prfaas.tenancy import TenantPolicy, Tenants
from prfaas.tenancy.policy import parse_policy

KEY = "k" * 32


def _instance(role: str, dc: str, n: int = 0) -> InstanceInfo:
    return InstanceInfo(instance_id=f"{role}-{dc}-{n}", role=role, url=f"http://{role}{n}", datacenter=dc,
                        kv_address=f"127.0.0.1:{9000 + n}")


@pytest.mark.parametrize(("spec", "message"), [
    ({"kv_ttl_seconds": 30}, "kv_ttl_seconds"), ({"kv_ttl_seconds": 301}, "kv_ttl_seconds"),
    ({"kv_codec": "zip"}, "kv_codec"), ({"rate_limit_qps": -1}, "rate_limit_qps"),
    ({"allowed_datacenters": "dc-b"}, "allowed_datacenters"), ({"prompt_may_cross": "no"}, "prompt_may_cross"),
    ({"redact": "no.such.module:hook"}, "redaction hook"), ({"colour": "blue"}, "a mapping of"),
])
def test_out_of_limits_policies_are_refused_at_load(spec: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        from_dict({"tenants": {"acme": spec}})


def test_tenant_names_and_key_tenants_are_checked() -> None:
    with pytest.raises(InvalidRequest, match="tenant name"):
        parse_policy("Acme Corp", {})
    with pytest.raises(InvalidRequest, match="tenant name"):
        parse_keys([{"name": "a", "key": KEY, "tenant": "Not Valid"}])
    keys = parse_keys([{"name": "a", "key": KEY, "tenant": "acme"}, "x" * 20])
    assert [k.tenant for k in keys] == ["acme", "default"]
    assert "acme" in Tenants.from_config({}, [k.tenant for k in keys]).policies


def test_a_pinned_tenant_is_never_offloaded_even_when_the_scheduler_would() -> None:
    scheduler = Scheduler(from_dict({"offload_threshold_tokens": 10}).router, "relay")
    prefills, relays = [_instance("prefill", "dc-a")], [_instance("relay", "dc-b")]
    assert scheduler.route(5000, prefills, relays).route == "remote"  # what it would prefer
    pinned = TenantPolicy("acme", allowed_datacenters=("dc-b",))
    for _ in range(50):
        decision = scheduler.route(5000, prefills, relays, pinned, home="dc-b")
        assert (decision.route, decision.reason_code) == ("local", "tenant_residency")
        assert "acme" in decision.reason and "dc-a" in decision.reason


def test_residency_policy_beats_fallback_off_and_picks_an_allowed_prefill() -> None:
    scheduler = Scheduler(from_dict({"offload_threshold_tokens": 10, "fallback_local_prefill": False}).router, "direct")
    pinned = TenantPolicy("acme", allowed_datacenters=("dc-b",))
    decision = scheduler.route(500, [_instance("prefill", "dc-a")], [], pinned, home="dc-b")
    assert decision.route == "local"  # the policy keeps it local: no refusal for want of a remote path
    with pytest.raises(KVUnavailable):
        scheduler.route(500, [], [], pinned, home="dc-b")
    several = [_instance("prefill", "dc-a", 1), _instance("prefill", "dc-c", 2)]
    allowed = TenantPolicy("beta", allowed_datacenters=("dc-b", "dc-c"))
    picks = {scheduler.route(500, several, [], allowed, "dc-b").prefill.datacenter for _ in range(30)}
    assert picks == {"dc-c"}


def test_prompt_may_not_cross_and_relay_residency() -> None:
    scheduler = Scheduler(from_dict({"offload_threshold_tokens": 10}).router, "relay")
    local_only = TenantPolicy("acme", prompt_may_cross=False)
    decision = scheduler.route(500, [_instance("prefill", "dc-a")], [_instance("relay", "dc-b")], local_only, "dc-b")
    assert decision.reason_code == "tenant_prompt_local"
    relay_elsewhere = TenantPolicy("beta", allowed_datacenters=("dc-a", "dc-b"))
    decision = scheduler.route(500, [_instance("prefill", "dc-a")], [_instance("relay", "dc-x")], relay_elsewhere,
                               "dc-b")
    assert (decision.route, decision.reason_code) == ("local", "tenant_residency")
    assert "relay" in decision.reason


def test_tenant_rate_limit_is_its_own() -> None:
    tenants = Tenants.from_config({"slow": {"rate_limit_qps": 1}})
    assert tenants.admit("slow") == 0.0
    assert tenants.admit("slow") > 0.0
    assert all(tenants.admit("other") == 0.0 for _ in range(100))
