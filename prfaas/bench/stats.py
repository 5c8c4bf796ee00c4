"""Per-cell metrics from request records: TTFT/TPOT/ITL/E2E percentiles, throughput, goodput, and the prfaas
transfer view (transfer success, retries, degradations, fallbacks) for requests outside any fault window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from prfaas.bench.client import RequestRecord

QUANTILES = (50, 90, 99)


def percentile(samples: list[float], q: float) -> float | None:
    """Nearest-rank percentile (always one of the samples, as load tools report them); None for no samples."""
    return float(np.percentile(samples, q, method="inverted_cdf")) if samples else None


def latency(samples_s: list[float]) -> dict[str, float | None]:
    """P50/P90/P99 and mean, in milliseconds."""
    out: dict[str, float | None] = {f"p{q}": _ms(percentile(samples_s, q)) for q in QUANTILES}
    out["mean"] = _ms(sum(samples_s) / len(samples_s)) if samples_s else None
    return out


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 2)


def in_window(record: RequestRecord, windows: Sequence[tuple[float, float]]) -> bool:
    """Did the request run while a fault was on?"""
    end = record.start + (record.e2e_s or 0.0)
    return any(record.start <= w[1] and end >= w[0] for w in windows)


def summarize(records: list[RequestRecord], wall_s: float, windows: Sequence[tuple[float, float]] = (),
              ttft_goal_s: float | None = None, tpot_goal_s: float | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if (ttft_goal_s is None or (r.ttft_s or 0) <= ttft_goal_s)
            and (tpot_goal_s is None or (r.tpot_s or 0) <= tpot_goal_s)]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "requests": len(records), "ok": len(ok), "errors": errors, "failures": failures(records),
        "success_rate": len(ok) / len(records) if records else None,
        "ttft_ms": latency([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": latency([g for r in ok for g in r.itl_s]),
        "e2e_ms": latency([r.e2e_s for r in ok if r.e2e_s is not None]),
        "output_tokens_mean": round(tokens / len(ok), 1) if ok else None,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "goodput_rps": round(len(good) / wall_s, 3) if wall_s > 0 else None,
        "transfer": transfer_view([r for r in records if not in_window(r, windows)]),
        "transfer_in_fault": transfer_view([r for r in records if in_window(r, windows)]) if windows else None,
    }


def failures(records: list[RequestRecord]) -> list[dict[str, Any]]:
    """Failed requests grouped by HTTP status and error code, most frequent first, each with one message the
    target gave (so a report says which error the requests got, not only that they failed)."""
    groups: dict[tuple[int | None, str], dict[str, Any]] = {}
    for r in records:
        if not r.ok:
            key = (r.status, r.error or "NO_TOKENS")
            group = groups.setdefault(key, {"status": r.status, "code": key[1], "count": 0, "message": r.message})
            group["count"] += 1
    return sorted(groups.values(), key=lambda g: -g["count"])


def describe_failures(groups: list[dict[str, Any]]) -> str:
    """``12 × HTTP 400 invalid_request_error (token ids must be in [0, 600))``; '' when nothing failed."""
    return "; ".join(f"{g['count']} × {'HTTP ' + str(g['status']) + ' ' if g['status'] else ''}{g['code']}"
                     + (f" ({g['message']})" if g["message"] else "") for g in groups)


def transfer_view(records: list[RequestRecord]) -> dict[str, Any]:
    """From the ``prfaas`` field: a transfer was attempted for every remote route and every fallback; it
    succeeded when the request stayed remote. A degradation is a long prompt kept local by the link's health (a
    local route whose reason is not the offload threshold) or a fallback."""
    remote = [r for r in records if r.prfaas.get("route") == "remote" and r.ok]
    fallbacks = [r for r in records if r.prfaas.get("fallback")]
    kv_failed = [r for r in records if (r.error or "").startswith("KV_")]
    degraded = [r for r in records if r.prfaas.get("fallback") or (
        r.prfaas.get("route") == "local" and "threshold" not in str(r.prfaas.get("reason", "")))]
    attempts = len(remote) + len(fallbacks) + len(kv_failed)
    retries = sum(int(r.prfaas.get("retries") or 0) for r in records)
    transfer_ms = [float(r.prfaas["transfer_ms"]) for r in remote if r.prfaas.get("transfer_ms") is not None]
    prfaas_seen = sum(1 for r in records if r.prfaas)
    return {
        "prfaas_responses": prfaas_seen, "attempts": attempts, "remote_ok": len(remote),
        "fallbacks": len(fallbacks), "degraded": len(degraded), "retries": retries,
        "success_rate": len(remote) / attempts if attempts else None,
        "retry_rate": retries / attempts if attempts else None,
        "degrade_rate": len(degraded) / prfaas_seen if prfaas_seen else None,
        "transfer_ms": {f"p{q}": _round(percentile(transfer_ms, q)) for q in (50, 99)},
        "kv_bytes": sum(int(r.prfaas.get("kv_bytes") or 0) for r in remote),
        "kv_ids": [r.prfaas["kv_id"] for r in records if r.prfaas.get("kv_id") and not r.prfaas.get("fallback")],
        "fallback_kv_ids": [r.prfaas["kv_id"] for r in fallbacks if r.prfaas.get("kv_id")],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
