"""What a prfaas target tells beyond the OpenAI API: KV store contents and deletion records (``/admin/kv``) and
the router's ``/metrics``. Against another server (vLLM, SGLang) these are absent and the report says so."""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Verify = ssl.SSLContext | bool  # what an https:// target's certificate is checked against (prfaas.tls)


async def kv_snapshot(url: str, verify: Verify = True) -> dict[str, Any] | None:
    """Live blobs and deletion records of every store, or None when the target has no ``/admin/kv``."""
    try:
        async with httpx.AsyncClient(timeout=10.0, verify=verify) as client:
            reply = await client.get(f"{url}/admin/kv")
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    stores = reply.json()
    live = sum(int((s.get("store") or {}).get("blobs", 0)) for s in stores.values())
    records = {r["kv_id"]: r for s in stores.values() for r in s.get("records", [])}
    return {"live_blobs": live, "records": records}


def kv_release(before: dict[str, Any] | None, after: dict[str, Any] | None, kv_ids: list[str],
               within_s: float, fallback_ids: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Did every KV blob of this cell end by release, within ``within_s`` of its creation, leaving no live blob?

    ``kv_ids`` are the blobs requests were served from: each must have ended, released. ``fallback_ids`` are those
    of requests that fell back to local prefill: their push may never have reached a store (``never_stored``, no
    record anywhere, and nothing live once the cell settles) or ended aborted, and either is the clean outcome; a
    fallback blob still live counts in ``live_after`` like any other."""
    if before is None or after is None:
        return {"available": False}
    fallback = set(fallback_ids)
    ended = [r for kv_id, r in after["records"].items() if kv_id not in before["records"]]
    reasons: dict[str, int] = {}
    for r in ended:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    wrong = [r for r in ended if r["reason"] != "released" and not (r["reason"] == "aborted"
                                                                    and r["kv_id"] in fallback)]
    late = [r for r in ended if r["reason"] == "released" and (r["deleted_ms"] - r["created_ms"]) > within_s * 1e3]
    missing = [k for k in kv_ids if k not in after["records"]]
    lifetimes = sorted(r["deleted_ms"] - r["created_ms"] for r in ended if r["reason"] == "released")
    return {
        "available": True, "ended": len(ended), "reasons": reasons, "late": len(late),
        "not_ended": len(missing), "live_after": after["live_blobs"],
        "never_stored": sum(1 for k in fallback if k not in after["records"]),
        "release_ms_max": lifetimes[-1] if lifetimes else None,
        "eviction_rate": reasons.get("evicted", 0) / len(ended) if ended else None,
        "on_time": not late and not missing and not wrong and after["live_blobs"] == 0,
    }


async def settle(url: str, within_s: float, verify: Verify = True) -> dict[str, Any] | None:
    """Wait (bounded by ``within_s``) until no blob is live, then snapshot."""
    deadline = time.monotonic() + within_s
    while True:
        snap = await kv_snapshot(url, verify)
        if snap is None or snap["live_blobs"] == 0 or time.monotonic() > deadline:
            return snap
        await asyncio.sleep(0.25)


async def metrics_text(url: str, verify: Verify = True) -> str:
    """The router's Prometheus text ('' when absent)."""
    try:
        async with httpx.AsyncClient(timeout=10.0, verify=verify) as client:
            reply = await client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return ""
    return reply.text if reply.status_code == 200 else ""


def sample_sums(text: str) -> dict[str, float]:
    """Each sample name in Prometheus text with its values summed over every label set; {} for text that does not
    parse (a target that serves something else at /metrics has no counters to show)."""
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    except ValueError:
        return {}
    return sums


ROUTER_COUNTERS = ("prfaas_router_requests_total", "prfaas_router_fallbacks_total", "prfaas_router_errors_total",
                   "prfaas_router_rate_limited_total", "prfaas_transfer_retries_total", "prfaas_transfer_bytes_total")


async def router_counters(url: str, verify: Verify = True) -> dict[str, float]:
    """The router's counters that a cell's report shows as differences (empty against a non-prfaas target)."""
    sums = sample_sums(await metrics_text(url, verify))
    return {name: sums.get(name, 0.0) for name in ROUTER_COUNTERS} if sums else {}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before.get(name, 0.0), 3) for name in after}
