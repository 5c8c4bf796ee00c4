"""Metering per tenant and per datacenter pair, so that transfer cost can be charged and capacity planned.

Two records feed it, written by the process that knows each fact:

- the router, once per finished request: ``tenant``, ``src_dc`` (where it was prefilled: the prefill's datacenter
  on the remote route, the decode's on the local one), ``dst_dc`` (the decode's), ``route``, ``status``,
  ``prompt_tokens``, ``output_tokens``, and ``kv_wan_bytes`` (the blob's bytes when it crossed between two
  datacenters, once per blob: retransmissions are transport overhead, not usage). It goes to the metrics below and,
  when ``audit_log`` is set, to the router's own hash-chained log as a ``request`` entry (no prompt, no key),
  between an ``open`` and a ``close`` entry like a store's session (``prfaas audit verify`` checks it the same);
- each store, once per blob that ends: ``bytes × (deleted − created)`` as KV byte-seconds held, under the blob's
  tenant and the store's datacenter (``prfaas_tenant_kv_byte_seconds_total``; the deletion records of the store's
  audit log carry the same facts).

``usage_report`` sums the audit logs into the daily JSON of ``prfaas admin usage``: per tenant, per datacenter
pair, requests (and how many remote), tokens, WAN bytes, byte-seconds held per datacenter, and the offload fraction
(remote / all requests; in PromQL: ``sum by (tenant) (prfaas_tenant_requests_total{route="remote"}) / sum by
(tenant) (prfaas_tenant_requests_total)``).
And per client cluster of a shared prefill pool (the prefill instances' ``pool`` entries, ``prfaas.services.pool``):
prompts prefilled, prompt tokens, forward-pass seconds, KV bytes per link, and prompts refused over quota.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from prfaas.audit.chain import ChainLog
from prfaas.obs import metrics
from prfaas.records import DeletionRecord

REQUEST = "request"
POOL = "pool"  # a prefill instance's entry per prompt of a client cluster (prfaas.services.pool)
QUOTA = "POOL_QUOTA_EXCEEDED"  # prfaas.errors.PoolQuotaExceeded.code


@dataclass(frozen=True)
class RequestUsage:
    tenant: str
    src_dc: str
    dst_dc: str
    route: str
    status: str
    prompt_tokens: int
    output_tokens: int
    kv_wan_bytes: int


class Meter:
    """The router's side: one ``record`` per finished request."""

    def __init__(self, audit_path: str = "", datacenter: str = "") -> None:
        self.log = ChainLog(audit_path) if audit_path else None
        self.requests = 0
        if self.log is not None:
            self.log.append("open", {"store": "router-usage", "role": "router", "datacenter": datacenter,
                                     "at_ms": _ms()})

    def record(self, usage: RequestUsage) -> None:
        pair = (usage.tenant, usage.src_dc, usage.dst_dc)
        metrics.TENANT_REQUESTS.labels(*pair, usage.route, usage.status).inc()
        metrics.TENANT_PROMPT_TOKENS.labels(*pair).inc(usage.prompt_tokens)
        metrics.TENANT_OUTPUT_TOKENS.labels(*pair).inc(usage.output_tokens)
        if usage.kv_wan_bytes:
            metrics.TENANT_KV_WAN_BYTES.labels(*pair).inc(usage.kv_wan_bytes)
        self.requests += 1
        if self.log is not None:
            self.log.append(REQUEST, {**asdict(usage), "at_ms": _ms()})

    def close(self) -> None:
        if self.log is not None:
            self.log.append("close", {"store": "router-usage", "at_ms": _ms(), "requests": self.requests})
            self.log.close()


def _ms() -> int:
    return int(time.time() * 1000)


def router_log_path(audit_log: str) -> str:
    """Where the router writes its ``request`` entries: ``audit_log`` with ``{instance}`` → ``router-usage`` (or
    with ``.router-usage`` appended when the pattern names no instance). A log of its own, apart from the router's
    security audit log (``router``): one writer per file keeps each chain whole."""
    if not audit_log:
        return ""
    name = "router-usage"
    return audit_log.replace("{instance}", name) if "{instance}" in audit_log else f"{audit_log}.{name}"


def held(record: DeletionRecord, datacenter: str) -> None:
    """The store's side: the KV byte-seconds one ended blob was held, under its tenant."""
    seconds = max(0, record.deleted_ms - record.created_ms) / 1000
    metrics.TENANT_KV_BYTE_SECONDS.labels(record.tenant, datacenter).inc(record.bytes * seconds)


def usage_report(entries: list[dict[str, Any]], day: str | None = None) -> dict[str, Any]:
    """Per-tenant usage from audit-log entries (routers' ``request``s, stores' ``open``s and ``deletion``s),
    restricted to the UTC ``day`` (``YYYY-MM-DD``) when given: requests by their finish, blobs by their end."""
    lo, hi = _day_bounds(day)
    store_dc = {str(e.get("store")): str(e.get("datacenter", "")) for e in entries if e.get("kind") == "open"}
    tenants: dict[str, dict[str, Any]] = defaultdict(_tenant)
    for e in entries:
        if e.get("kind") == REQUEST and lo <= int(e.get("at_ms", 0)) < hi:
            row = tenants[str(e.get("tenant"))]["pairs"].setdefault(f"{e.get('src_dc')}->{e.get('dst_dc')}",
                                                                   _pair())
            row["requests"] += 1
            row["remote"] += e.get("route") == "remote"
            row["failed"] += e.get("status") != "ok"
            for key in ("prompt_tokens", "output_tokens", "kv_wan_bytes"):
                row[key] += int(e.get(key, 0))
        elif e.get("kind") == "deletion" and lo <= int(e.get("deleted_ms", 0)) < hi:
            seconds = max(0, int(e.get("deleted_ms", 0)) - int(e.get("created_ms", 0))) / 1000
            held_at = tenants[str(e.get("tenant", ""))]["kv_byte_seconds"]
            dc = store_dc.get(str(e.get("store")), "")
            held_at[dc] = held_at.get(dc, 0.0) + int(e.get("bytes", 0)) * seconds
    for usage in tenants.values():
        _totals(usage)
    clusters = _clusters([e for e in entries if e.get("kind") == POOL and lo <= int(e.get("at_ms", 0)) < hi])
    return {"day": day, "generated_ms": int(time.time() * 1000), "tenants": dict(sorted(tenants.items())),
            "clusters": clusters}


def _clusters(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per client cluster: what the pool prefilled for it (``status`` ok), refused over quota, or failed."""
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"prefills": 0, "refused_over_quota": 0, "failed": 0,
                                                          "prompt_tokens": 0, "prefill_seconds": 0.0,
                                                          "kv_bytes": {}})
    for e in entries:
        row, status = out[str(e.get("cluster"))], str(e.get("status"))
        if status == "ok":
            row["prefills"] += 1
            row["prompt_tokens"] += int(e.get("prompt_tokens", 0))
            row["prefill_seconds"] = round(row["prefill_seconds"] + float(e.get("prefill_seconds", 0.0)), 6)
            link = str(e.get("link", ""))
            row["kv_bytes"][link] = row["kv_bytes"].get(link, 0) + int(e.get("kv_bytes", 0))
        elif status == QUOTA:
            row["refused_over_quota"] += 1
        else:
            row["failed"] += 1
    return dict(sorted(out.items()))


def _tenant() -> dict[str, Any]:
    return {"pairs": {}, "kv_byte_seconds": {}}


def _pair() -> dict[str, int]:
    return {"requests": 0, "remote": 0, "failed": 0, "prompt_tokens": 0, "output_tokens": 0, "kv_wan_bytes": 0}


def _totals(usage: dict[str, Any]) -> None:
    total = _pair()
    for row in usage["pairs"].values():
        for key in total:
            total[key] += row[key]
    usage["total"] = {**total, "kv_byte_seconds": round(sum(usage["kv_byte_seconds"].values()), 3),
                      "offload_fraction": round(total["remote"] / total["requests"], 4) if total["requests"] else 0.0}


def _day_bounds(day: str | None) -> tuple[int, int]:
    if not day:
        return 0, 1 << 62
    start = dt.datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=dt.UTC)
    return int(start.timestamp() * 1000), int((start + dt.timedelta(days=1)).timestamp() * 1000)


def today() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
