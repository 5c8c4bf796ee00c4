"""Every prfaas metric, defined once. Names are ``prfaas_<component>_<what>_<unit>``; labels never carry prompt
text, ``kv_id``s or keys."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry()
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

REQUESTS = Counter("prfaas_router_requests_total", "Requests by route and outcome",
                   ["route", "status"], registry=REGISTRY)
TTFT = Histogram("prfaas_request_ttft_seconds", "Time to first token seen by the router",
                 ["route"], buckets=_LATENCY, registry=REGISTRY)
E2E = Histogram("prfaas_request_e2e_seconds", "Whole request latency seen by the router",
                ["route"], buckets=_LATENCY, registry=REGISTRY)
FALLBACKS = Counter("prfaas_router_fallbacks_total", "Remote prefills that fell back to local prefill",
                    ["reason"], registry=REGISTRY)
INSTANCES = Gauge("prfaas_registry_instances", "Registered instances", ["role", "healthy"], registry=REGISTRY)
TRANSFER_SECONDS = Histogram("prfaas_transfer_seconds", "KV pull time on decode (first byte to verified blob)",
                             buckets=_LATENCY, registry=REGISTRY)
TRANSFER_BYTES = Counter("prfaas_transfer_bytes_total", "KV blob bytes pulled by decode", registry=REGISTRY)
PREFILL_SECONDS = Histogram("prfaas_prefill_seconds", "Prefill forward pass time", buckets=_LATENCY,
                            registry=REGISTRY)
KV_BLOBS = Counter("prfaas_store_blobs_ended_total", "KV blobs that ended, by reason", ["reason"],
                   registry=REGISTRY)


def render() -> bytes:
    return generate_latest(REGISTRY)
