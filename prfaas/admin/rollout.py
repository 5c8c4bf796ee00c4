"""``prfaas admin rollout``: the traffic half of a rolling upgrade, against a live router.

Before it runs, the new model's instances run beside the old ones and are registered (docs/operations.md: pin the
old pool by its key, admit the model name at weight 0, start the new instances). Then:

1. pre-flight (``prfaas.admin.check``): any error stops the rollout before traffic moves;
2. canary steps: for each step ``w`` the new pool gets weight ``w`` and every old pool ``100 - w``; during each
   hold the router's per-pool outcomes (``prfaas_router_pool_requests_total``) are watched. Errors caused by the
   deployment (not by clients: bad requests, rate limits, keys, streams the client left) in the new pool, at a
   higher rate than in the old pools over the same hold, roll the weights back (old 100, new 0) and stop with
   ``RolloutFailed``. Errors of the old pools alone do not: under real load some requests always fail somewhere,
   and the canary is judged against the fleet it would replace;
3. drain every instance of the old pools, prefill before decode (an old prefill's blobs are read by an old
   decode), one at a time, each until it has left the registry.

The router pairs only matching fingerprints, so no KV crosses pools at any step; the drains let every request
that was already placed on an old instance finish there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from prfaas.admin.check import ERROR, check, pool_key
from prfaas.admin.client import AdminError, RouterClient

CLIENT_CODES = frozenset({"INVALID_REQUEST", "RATE_LIMITED", "PROMPT_REFUSED", "cancelled"})
ROLE_ORDER = {"prefill": 0, "decode": 1}
POLL_S = 0.25


class RolloutFailed(AdminError):
    """The rollout stopped; ``str`` says why and what state the weights were left in."""


@dataclass
class Rollout:
    """What happened, with times in seconds from the start (``prfaas admin rollout --json`` prints it)."""

    new_pool: str
    old_pools: list[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def note(self, action: str, **facts: Any) -> dict[str, Any]:
        event = {"at_s": round(time.monotonic() - self.started, 3), "action": action, **facts}
        self.events.append(event)
        return event

    def to_json(self) -> dict[str, Any]:
        return {"new_pool": self.new_pool, "old_pools": self.old_pools, "events": self.events,
                "duration_s": round(time.monotonic() - self.started, 3)}


def resolve_pool(pools: dict[str, Any], name: str) -> str:
    """The pool key that ``name`` (a pool key or an unambiguous model name) designates."""
    keys = [p["pool"] for p in pools["pools"] if name in (p["pool"], p["model"])]
    if len(keys) != 1:
        known = ", ".join(f"{p['pool']} ({p['model']})" for p in pools["pools"])
        raise RolloutFailed(f"{name!r} names {len(keys)} pools; give one pool key of: {known}")
    return str(keys[0])


def pool_outcomes(metrics_text: str) -> dict[str, dict[str, float]]:
    """``{pool: {outcome: requests}}`` so far, from the router's ``prfaas_router_pool_requests_total``."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "prfaas_router_pool_requests_total":
                pool = out.setdefault(sample.labels.get("pool", ""), {})
                outcome = sample.labels.get("outcome", "")
                pool[outcome] = pool.get(outcome, 0.0) + sample.value
    return out


def judge_step(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], new_pool: str,
               old_pools: Sequence[str]) -> dict[str, Any]:
    """Requests and deployment errors of the new pool and of the old pools between two ``pool_outcomes``, and
    ``rollback``: the new pool had such errors at a higher rate than the old pools."""
    def tally(pools: Sequence[str]) -> tuple[float, float]:
        requests = errors = 0.0
        for pool in pools:
            for outcome, n in after.get(pool, {}).items():
                grew = n - before.get(pool, {}).get(outcome, 0.0)
                requests += grew
                errors += grew if outcome != "ok" and outcome not in CLIENT_CODES else 0.0
        return requests, errors

    (new_req, new_err), (old_req, old_err) = tally([new_pool]), tally(old_pools)
    new_rate, old_rate = (new_err / new_req if new_req else 0.0), (old_err / old_req if old_req else 0.0)
    return {"new_requests": new_req, "new_errors": new_err, "old_requests": old_req, "old_errors": old_err,
            "rollback": new_err > 0 and new_rate > old_rate}


def wait_gone(client: RouterClient, instance: str, timeout_s: float) -> float | None:
    """Seconds until ``instance`` left the registry (after ``POST /admin/drain/{instance}``), None at the timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if instance not in {i["instance_id"] for i in client.get("/admin/instances")}:
            return time.monotonic() - started
        time.sleep(POLL_S)
    return None


def rollout(client: RouterClient, to: str, steps: Sequence[float], hold_s: float, drain: bool = True,
            drain_timeout_s: float = 600.0, echo: Callable[[str], None] = print) -> Rollout:
    pools = client.get("/admin/pools")
    new = resolve_pool(pools, to)
    old = [p["pool"] for p in pools["pools"] if p["pool"] != new and p["instances"]]
    run = Rollout(new, old)
    _preflight(client, run, echo)
    for weight in steps:
        _step(client, run, weight, hold_s, echo)
    if drain:
        _drain_old(client, run, drain_timeout_s, echo)
    run.note("done")
    return run


def _preflight(client: RouterClient, run: Rollout, echo: Callable[[str], None]) -> None:
    findings = check(client.get("/admin/instances"), client.get("/admin/pools"))
    errors = [f.message for f in findings if f.level == ERROR]
    run.note("check", errors=errors)
    if errors:
        raise RolloutFailed("pre-flight check failed, no traffic moved: " + "; ".join(errors))
    echo(f"pre-flight: no problem; moving traffic from {', '.join(run.old_pools) or 'nothing'} to {run.new_pool}")


def _weights(client: RouterClient, run: Rollout, new: float) -> None:
    client.post("/admin/pools", {"weights": {run.new_pool: new, **{k: 100 - new for k in run.old_pools}}})


def _step(client: RouterClient, run: Rollout, weight: float, hold_s: float, echo: Callable[[str], None]) -> None:
    before = pool_outcomes(client.text("/metrics"))
    _weights(client, run, weight)
    run.note("weight", new=weight, old=100 - weight)
    echo(f"weight {run.new_pool} {weight:g}, old pools {100 - weight:g}; holding {hold_s:g} s")
    time.sleep(hold_s)
    seen = judge_step(before, pool_outcomes(client.text("/metrics")), run.new_pool, run.old_pools)
    facts = {k: v for k, v in seen.items() if k != "rollback"}
    if seen["rollback"]:
        _weights(client, run, 0)
        run.note("rollback", **facts)
        raise RolloutFailed(f"{seen['new_errors']:g} of {seen['new_requests']:g} requests to {run.new_pool} failed at "
                            f"weight {weight:g} (old pools: {seen['old_errors']:g} of {seen['old_requests']:g}): "
                            f"rolled back (new pool weight 0, old pools 100); nothing was drained")
    run.note("held", **facts)


def _drain_old(client: RouterClient, run: Rollout, timeout_s: float, echo: Callable[[str], None]) -> None:
    olds = [i for i in client.get("/admin/instances") if i.get("fingerprint") and pool_key(i) in run.old_pools]
    for info in sorted(olds, key=lambda i: (ROLE_ORDER.get(i["role"], 2), i["instance_id"])):
        iid = info["instance_id"]
        echo(f"draining {iid} ({info['role']})")
        client.post(f"/admin/drain/{iid}")
        took = wait_gone(client, iid, timeout_s)
        run.note("drained", instance=iid, role=info["role"], seconds=None if took is None else round(took, 3))
        if took is None:
            raise RolloutFailed(f"{iid} was still registered {timeout_s:g} s after its drain began; traffic is "
                                f"on {run.new_pool}, later old instances were not drained")
        echo(f"{iid}: drained and gone after {took:.1f} s")
