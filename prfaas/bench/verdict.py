"""The pass/fail of one cell against the acceptance criteria, each check with its measured value and limit, so a
failing report says why; and the run's verdict over its cells, which is never PASS over a cell that did not run."""

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


def overall(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's verdict: ``PASS`` only when every cell ran and passed; ``FAIL`` when a cell that ran failed;
    else ``NOT JUDGED`` (cells skipped, or none ran), with how many were skipped and why."""
    judged = [c for c in cells if not c.get("skipped")]
    reasons: dict[str, int] = {}
    for c in cells:
        if c.get("skipped"):
            reasons[c["skipped"]] = reasons.get(c["skipped"], 0) + 1
    failed = any(not c["verdict"]["pass"] for c in judged)
    verdict = "FAIL" if failed else "PASS" if judged and not reasons else "NOT JUDGED"
    return {"pass": verdict == "PASS", "verdict": verdict,
            "skipped": {"cells": sum(reasons.values()), "of": len(cells), "reasons": reasons}}


def verdict_line(results: dict[str, Any]) -> str:
    """``PASS`` / ``FAIL`` / ``not judged: 3 of 4 cells skipped (no lab: …)``, as the report and stdout say it."""
    skipped = results["skipped"]
    why = "; ".join(f"{n} × {reason}" if n > 1 else reason for reason, n in skipped["reasons"].items())
    note = f"{skipped['cells']} of {skipped['of']} cells skipped ({why})" if skipped["cells"] else ""
    if results["verdict"] == "NOT JUDGED":
        return f"not judged: {note or 'no cell ran'}"
    return results["verdict"] + (f"; {note}" if note else "")
