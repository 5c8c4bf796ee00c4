"""The pure parts of `prfaas admin rollout` and the admin client: when a step's errors roll a canary back (per
pool, against the old pools' rate), how a pool is named, and that the API key never shows. The rollout itself runs
end to end in tests/services/test_upgrade.py and test_upgrade_rollback.py."""

from __future__ import annotations

import pytest

from prfaas.admin.client import RouterClient
from prfaas.admin.rollout import RolloutFailed, judge_step, pool_outcomes, resolve_pool

HELP = """# HELP prfaas_router_pool_requests_total Requests placed in a pool (canary weights), by outcome
# TYPE prfaas_router_pool_requests_total counter
"""


def metrics(new: dict[str, int], old: dict[str, int]) -> str:
    """The router's exposition with these per-outcome totals for pools "new" and "old" (plus _created lines)."""
    lines = [f'prfaas_router_pool_requests_total{{outcome="{o}",pool="{p}"}} {n}.0'
             for p, counts in (("new", new), ("old", old)) for o, n in counts.items()]
    created = [f'prfaas_router_pool_requests_created{{outcome="ok",pool="{p}"}} 1.7e9' for p in ("new", "old")]
    return HELP + "\n".join(lines + created) + "\n"


def step(before: str, after: str) -> dict[str, object]:
    return judge_step(pool_outcomes(before), pool_outcomes(after), "new", ["old"])


def test_outcomes_are_read_per_pool_and_outcome() -> None:
    text = metrics({"ok": 3, "KV_UNAVAILABLE": 2}, {"ok": 90})
    assert pool_outcomes(text) == {"new": {"ok": 3.0, "KV_UNAVAILABLE": 2.0}, "old": {"ok": 90.0}}
    assert pool_outcomes("") == {}


def test_a_canary_failing_more_often_than_the_old_pools_is_rolled_back() -> None:
    start = metrics({"ok": 0}, {"ok": 100, "KV_TIMEOUT": 1})
    seen = step(start, metrics({"ok": 8, "KV_UNAVAILABLE": 2}, {"ok": 190, "KV_TIMEOUT": 1}))
    assert seen == {"new_requests": 10.0, "new_errors": 2.0, "old_requests": 90.0, "old_errors": 0.0,
                    "rollback": True}


def test_errors_elsewhere_or_caused_by_clients_do_not_roll_a_canary_back() -> None:
    start = metrics({"ok": 0}, {"ok": 100})
    # the old pools fail now and then (as any fleet under load does); the canary does not fail at all
    assert not step(start, metrics({"ok": 10}, {"ok": 180, "KV_TIMEOUT": 3}))["rollback"]
    # the canary's failures are client errors: bad requests, rate limits, streams the client left
    clients = {"ok": 10, "INVALID_REQUEST": 4, "RATE_LIMITED": 2, "cancelled": 1}
    assert not step(start, metrics(clients, {"ok": 190}))["rollback"]
    # the canary fails no more often than the fleet it replaces: 1 in 10 against 10 in 100
    assert not step(start, metrics({"ok": 9, "KV_TIMEOUT": 1}, {"ok": 190, "KV_TIMEOUT": 10}))["rollback"]
    # at the last step (old pools at weight 0) any canary error rolls it back
    assert step(start, metrics({"ok": 9, "KV_TIMEOUT": 1}, {"ok": 100}))["rollback"]


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
