"""The pure parts of `prfaas admin rollout` and the admin client: which errors roll a step back, how a pool is
named, and that the API key never shows. The rollout itself runs end to end in tests/services/test_upgrade.py."""

from __future__ import annotations

import pytest

from prfaas.admin.client import RouterClient
from prfaas.admin.rollout import RolloutFailed, deployment_errors, resolve_pool

METRICS = """# HELP prfaas_router_errors_total Requests that failed, by error code
# TYPE prfaas_router_errors_total counter
prfaas_router_errors_total{code="KV_UNAVAILABLE"} 2.0
prfaas_router_errors_total{code="INVALID_REQUEST"} 40.0
prfaas_router_errors_total{code="RATE_LIMITED"} 7.0
prfaas_router_errors_total{code="KV_INCOMPATIBLE"} 1.0
prfaas_router_errors_created{code="KV_UNAVAILABLE"} 1.7e9
prfaas_router_requests_total{route="remote",status="ok"} 100.0
"""


def test_only_deployment_errors_count_against_a_step() -> None:
    assert deployment_errors(METRICS) == 3.0  # client errors (bad requests, rate limits) do not roll back
    assert deployment_errors("") == 0.0


def test_a_pool_is_named_by_key_or_by_an_unambiguous_model() -> None:
    pools = {"pools": [{"pool": "aaa", "model": "m"}, {"pool": "bbb", "model": "m"}, {"pool": "ccc", "model": "x"}]}
    assert resolve_pool(pools, "bbb") == "bbb"
    assert resolve_pool(pools, "x") == "ccc"
    with pytest.raises(RolloutFailed, match="names 2 pools"):
        resolve_pool(pools, "m")  # one name on two pools: an upgrade in progress, give the key
    with pytest.raises(RolloutFailed, match="names 0 pools"):
        resolve_pool(pools, "nothing")


def test_the_key_is_never_shown() -> None:
    client = RouterClient("http://127.0.0.1:1/", api_key="secret-key-0123456789")
    assert "secret" not in repr(client) and "set" in repr(client)
    with pytest.raises(Exception) as caught:
        client.get("/admin/pools")
    assert "secret" not in str(caught.value) and "cannot reach the router" in str(caught.value)
