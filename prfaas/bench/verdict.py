"""The pass/fail of one cell against the acceptance criteria, each check with its measured value and limit, so a
failing report says why."""

from __future__ import annotations

from typing import Any

from prfaas.bench.matrix import Acceptance


def check(name: str, value: float | None, limit: float, higher_is_better: bool) -> dict[str, Any]:
    if value is None:
        return {"name": name, "value": None, "limit": limit, "pass": None}  # not measurable here: not judged
    ok = value >= limit if higher_is_better else value <= limit
    return {"name": name, "value": round(value, 4), "limit": round(limit, 4), "pass": ok}


def judge(metrics: dict[str, Any], acceptance: Acceptance, baseline: dict[str, Any] | None) -> dict[str, Any]:
    """``baseline`` is the monolithic run's metrics for the same load (None: the absolute TTFT P99 limit)."""
    ttft = metrics["ttft_ms"]
    checks = []
    if baseline:
        factor = 1 + acceptance.ttft_overhead
        for q in ("p50", "p99"):
            base = baseline["ttft_ms"][q]
            checks.append(check(f"ttft_{q}_ms", ttft[q], base * factor if base else float("inf"), False))
    else:
        checks.append(check("ttft_p99_ms", ttft["p99"], acceptance.ttft_p99_ms, False))
    transfer = metrics["transfer"]
    checks += [
        check("success_rate", metrics["success_rate"], acceptance.success_rate, True),
        check("transfer_success", transfer["success_rate"], acceptance.transfer_success, True),
        check("retry_rate", transfer["retry_rate"], acceptance.retry_rate, False),
        check("degrade_rate", transfer["degrade_rate"], acceptance.degrade_rate, False),
    ]
    kv = metrics.get("kv", {})
    if kv.get("available"):
        checks.append({"name": "kv_released_on_time", "value": kv["on_time"], "limit": True, "pass": kv["on_time"]})
    if metrics["requests"] == 0:
        checks.append({"name": "requests", "value": 0, "limit": 1, "pass": False})
    failed = [c["name"] for c in checks if c["pass"] is False]
    return {"pass": not failed, "failed": failed, "checks": checks}
