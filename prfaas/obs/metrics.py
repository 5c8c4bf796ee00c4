"""Every prfaas metric, defined once. Names are ``prfaas_<component>_<what>_<unit>``; labels never carry prompt
text, ``kv_id``s or keys.

Each metric lives in the registry of the component that updates it, and a process's ``/metrics`` renders only the
components it runs (``served``), so that no process exports another role's series at zero:

| registry         | what                                                               | rendered by      |
|------------------|--------------------------------------------------------------------|------------------|
| ``ROUTER``       | requests, routing, the registry, autoscaling signals, metering     | router           |
| ``PREFILL``      | prefill forward passes                                             | prefill          |
| ``DECODE``       | KV pulls as decode sees them                                       | decode           |
| ``STORE``        | a KV store: blobs, bytes, accesses, audit, KV byte-seconds         | prefill, relay   |
| ``DATA_PLANE``   | this process's KV transfers (``prfaas.transfer``: pushes, pulls)   | prefill, decode  |
| ``PREFIX``       | the engine's prefix cache (``prfaas.engine.prefix_cache``)         | prefill, decode  |

With ``--engine vllm`` the forward passes, the store and the data plane run inside the vLLM server's process (the
connector), so the prfaas instance in front of it renders none of them; that server's own ``/metrics`` has vLLM's
engine figures. Updating a metric of a component the process does not run is harmless: it is never rendered.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROUTER, PREFILL, DECODE, STORE, DATA_PLANE, PREFIX = (CollectorRegistry() for _ in range(6))
REGISTRIES = (ROUTER, PREFILL, DECODE, STORE, DATA_PLANE, PREFIX)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

REQUESTS = Counter("prfaas_router_requests_total", "Requests by route and outcome",
                   ["route", "status"], registry=ROUTER)
TTFT = Histogram("prfaas_request_ttft_seconds", "Time to first token seen by the router",
                 ["route"], buckets=_LATENCY, registry=ROUTER)
E2E = Histogram("prfaas_request_e2e_seconds", "Whole request latency seen by the router",
                ["route"], buckets=_LATENCY, registry=ROUTER)
ROUTES = Counter("prfaas_router_routes_total", "Route decisions by route and reason code", ["route", "reason"],
                 registry=ROUTER)
ERRORS = Counter("prfaas_router_errors_total", "Requests that failed, by error code", ["code"], registry=ROUTER)
POOL_REQUESTS = Counter("prfaas_router_pool_requests_total", "Requests placed in a pool (canary weights), by outcome: "
                        "ok, or the error code", ["pool", "outcome"], registry=ROUTER)
RATE_LIMITED = Counter("prfaas_router_rate_limited_total", "Requests refused by the rate limit", registry=ROUTER)
ITL = Histogram("prfaas_request_itl_seconds", "Inter-token latency seen by the router",
                buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0), registry=ROUTER)
TPOT = Histogram("prfaas_request_tpot_seconds", "Time per output token after the first, per request",
                 buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0), registry=ROUTER)
TRANSFER_EXPOSED = Histogram("prfaas_transfer_exposed_seconds",
                             "KV transfer time not hidden behind prefill compute (router's view)",
                             buckets=_LATENCY, registry=ROUTER)
LINK_DEGRADED = Gauge("prfaas_router_link_degraded", "1 while the link is degraded and requests stay local",
                      registry=ROUTER)
LINK_BANDWIDTH = Gauge("prfaas_router_link_bandwidth_bps", "Estimated available bandwidth per link "
                       "(prefill-dc:decode-dc), the cost model's input", ["link"], registry=ROUTER)
LINK_INFLIGHT = Gauge("prfaas_router_link_inflight_bytes", "KV bytes routed over each link and not yet delivered",
                      ["link"], registry=ROUTER)
QUEUE_DEPTH = Gauge("prfaas_instance_queue_depth", "Queue depth reported by each instance", ["instance"],
                    registry=ROUTER)
FREE_KV = Gauge("prfaas_instance_free_kv_bytes", "Free KV memory reported by each instance", ["instance"],
                registry=ROUTER)
REFUSED = Counter("prfaas_registry_refused_total", "Registrations refused, by reason", ["reason"],
                  registry=ROUTER)
FALLBACKS = Counter("prfaas_router_fallbacks_total", "Remote prefills that fell back to local prefill",
                    ["reason"], registry=ROUTER)
INSTANCES = Gauge("prfaas_registry_instances", "Registered instances", ["role", "healthy"], registry=ROUTER)
TRANSFER_SECONDS = Histogram("prfaas_transfer_seconds", "KV pull time on decode (first byte to verified blob)",
                             buckets=_LATENCY, registry=DECODE)
TRANSFER_BYTES = Counter("prfaas_transfer_bytes_total", "KV blob bytes pulled by decode", registry=DECODE)
PREFILL_SECONDS = Histogram("prfaas_prefill_seconds", "Prefill forward pass time", buckets=_LATENCY,
                            registry=PREFILL)
KV_BLOBS = Counter("prfaas_store_blobs_ended_total", "KV blobs that ended, by reason", ["reason"],
                   registry=STORE)
STORE_LIVE_BLOBS = Gauge("prfaas_store_live_blobs", "Live KV blobs in this process's store, by state", ["state"],
                         registry=STORE)
STORE_LIVE_BYTES = Gauge("prfaas_store_live_bytes", "Bytes of KV frames held by this process's store",
                         registry=STORE)
STORE_BUDGET_BYTES = Gauge("prfaas_store_budget_bytes", "Byte budget of this process's store", registry=STORE)
STORE_READERS = Gauge("prfaas_store_readers", "Reads of this process's store in progress", registry=STORE)
STORE_ACCESSES = Counter("prfaas_store_accesses_total", "Store accesses by action and outcome (ok or error code)",
                         ["action", "outcome"], registry=STORE)
STORE_BLOB_LIFETIME = Histogram("prfaas_store_blob_lifetime_seconds", "KV blob creation to deletion, by reason",
                                ["reason"], buckets=(*_LATENCY, 120.0, 300.0), registry=STORE)
STORE_AUDIT_FAILURES = Gauge("prfaas_store_audit_write_failures", "Audit log entries that could not be written",
                             registry=STORE)


# The KV data plane (prfaas.transfer); ``op`` is "pull" or "push". Fed by ``prfaas.transfer.stats``.
TRANSFER_BLOB_SECONDS = Histogram("prfaas_transfer_blob_seconds", "Whole-blob transfer time by operation",
                                  ["op"], buckets=_LATENCY, registry=DATA_PLANE)
TRANSFER_PAYLOAD_BYTES = Counter("prfaas_transfer_payload_bytes_total", "KV payload bytes moved by operation",
                                 ["op"], registry=DATA_PLANE)
TRANSFER_FAILURES = Counter("prfaas_transfer_failures_total", "Transfers that failed, by error code",
                            ["op", "code"], registry=DATA_PLANE)
TRANSFER_RETRIES = Counter("prfaas_transfer_retries_total", "Transfer retries started, by the error that caused "
                           "them", ["code"], registry=DATA_PLANE)
TRANSFER_RETRIES_REFUSED = Counter("prfaas_transfer_retries_refused_total", "Retries refused by the global cap "
                                   "(retries above 1 % of transfers in a minute)", registry=DATA_PLANE)
TRANSFER_GOODPUT = Gauge("prfaas_transfer_goodput_gbps", "Payload goodput over the last minute's transfers",
                         ["op"], registry=DATA_PLANE)
TRANSFER_P50 = Gauge("prfaas_transfer_p50_seconds", "Median whole-blob transfer time over the last minute",
                     ["op"], registry=DATA_PLANE)
TRANSFER_P99 = Gauge("prfaas_transfer_p99_seconds", "P99 whole-blob transfer time over the last minute",
                     ["op"], registry=DATA_PLANE)
TRANSFER_RTT = Gauge("prfaas_transfer_rtt_seconds", "Smoothed TCP RTT of the last data-plane connection "
                     "(TCP_INFO)", ["op"], registry=DATA_PLANE)
TRANSFER_RETRANSMITS = Counter("prfaas_transfer_retransmits_total", "TCP segments retransmitted on data-plane "
                               "connections (TCP_INFO)", ["op"], registry=DATA_PLANE)
TRANSFER_INFLIGHT = Gauge("prfaas_transfer_inflight", "KV blobs in flight in this process (bounded by "
                          "max_inflight_kv)", registry=DATA_PLANE)

# Autoscaling signals published by the router (prfaas.services.signals; `prfaas admin recommend`, HPA / KEDA).
SIGNAL_PREFILL_WAIT = Gauge("prfaas_router_prefill_queue_wait_seconds", "Longest expected wait in a prefill queue",
                            registry=ROUTER)
SIGNAL_DECODE_QUEUE = Gauge("prfaas_router_decode_queue_depth", "Requests queued or running on all decode instances",
                            registry=ROUTER)
SIGNAL_DECODE_FREE_KV = Gauge("prfaas_router_decode_free_kv_bytes", "Free KV memory over all decode instances",
                              registry=ROUTER)
SIGNAL_KV_EGRESS = Gauge("prfaas_router_kv_egress_bits_per_second", "KV bits sent across datacenters per second "
                         "over the last minute", registry=ROUTER)
SIGNAL_OFFLOAD_FRACTION = Gauge("prfaas_router_offload_fraction", "Share of last minute's requests prefilled "
                                "remotely", registry=ROUTER)
SIGNAL_ARRIVAL = Gauge("prfaas_router_arrival_rate_rps", "Requests finished per second over the last minute",
                       registry=ROUTER)
DRAINING = Gauge("prfaas_registry_draining_instances", "Registered instances that are draining", ["role"],
                 registry=ROUTER)

# Metering per tenant and datacenter pair (prfaas.tenancy.metering); tenants are names, never keys.
_PAIR = ["tenant", "src_dc", "dst_dc"]
TENANT_REQUESTS = Counter("prfaas_tenant_requests_total", "Finished requests by tenant, datacenter pair (prefilled "
                          "in src_dc, decoded in dst_dc), route and status", [*_PAIR, "route", "status"],
                          registry=ROUTER)
TENANT_PROMPT_TOKENS = Counter("prfaas_tenant_prompt_tokens_total", "Prompt tokens by tenant and datacenter pair",
                               _PAIR, registry=ROUTER)
TENANT_OUTPUT_TOKENS = Counter("prfaas_tenant_output_tokens_total", "Output tokens by tenant and datacenter pair",
                               _PAIR, registry=ROUTER)
TENANT_KV_WAN_BYTES = Counter("prfaas_tenant_kv_wan_bytes_total", "KV blob bytes moved between datacenters, by "
                              "tenant and pair", _PAIR, registry=ROUTER)
TENANT_KV_BYTE_SECONDS = Counter("prfaas_tenant_kv_byte_seconds_total", "KV bytes × seconds held in this "
                                 "datacenter's stores, by tenant", ["tenant", "datacenter"], registry=STORE)

# Metering per client cluster of a shared prefill pool (prfaas.services.pool); clusters are names, never keys.
POOL_PROMPT_TOKENS = Counter("prfaas_pool_prompt_tokens_total", "Prompt tokens prefilled, by client cluster",
                             ["cluster"], registry=PREFILL)
POOL_PREFILL_SECONDS = Counter("prfaas_pool_prefill_seconds_total", "Seconds of the forward passes that prefilled "
                               "each client cluster's prompts", ["cluster"], registry=PREFILL)
POOL_KV_BYTES = Counter("prfaas_pool_kv_bytes_total", "KV blob bytes written, by client cluster and link "
                        "(prefill datacenter->cluster datacenter)", ["cluster", "link"], registry=PREFILL)
POOL_REFUSED = Counter("prfaas_pool_refused_total", "Prefill requests refused, by client cluster and reason "
                       "(quota, unauthorized)", ["cluster", "reason"], registry=PREFILL)
POOL_QUEUE_SECONDS = Histogram("prfaas_pool_queue_seconds", "Wait in the prefill queue, by client cluster",
                               ["cluster"], buckets=_LATENCY, registry=PREFILL)
POOL_INFLIGHT_TOKENS = Gauge("prfaas_pool_inflight_tokens", "Prompt tokens accepted and not yet finished, by "
                             "client cluster", ["cluster"], registry=PREFILL)

# The engine's prefix cache (prfaas.engine.prefix_prefill), by the role whose engine holds it. Hit rate is
# saved / prompt tokens.
PREFIX_LOOKUPS = Counter("prfaas_prefix_cache_lookups_total", "Prompts looked up in the prefix cache, by outcome "
                         "(hit or miss)", ["role", "outcome"], registry=PREFIX)
PREFIX_PROMPT_TOKENS = Counter("prfaas_prefix_cache_prompt_tokens_total", "Prompt tokens of the prompts looked up",
                               ["role"], registry=PREFIX)
PREFIX_SAVED_TOKENS = Counter("prfaas_prefix_cache_saved_tokens_total", "Prompt tokens reused from the prefix cache "
                              "instead of prefilled", ["role"], registry=PREFIX)
PREFIX_HIT_RATIO = Gauge("prfaas_prefix_cache_hit_ratio", "Saved over prompt tokens since the process started",
                         ["role"], registry=PREFIX)
PREFIX_CACHED_TOKENS = Gauge("prfaas_prefix_cache_tokens", "Prompt tokens held in the prefix cache (blocks × block "
                             "size)", ["role"], registry=PREFIX)
PREFIX_BYTES = Gauge("prfaas_prefix_cache_bytes", "Bytes held in the prefix cache", ["role"], registry=PREFIX)
PREFIX_EVICTIONS = Counter("prfaas_prefix_cache_evictions_total", "Blocks evicted from the prefix cache to stay "
                           "within prefix_cache_mb", ["role"], registry=PREFIX)
PREFIX_WAN_SAVED = Counter("prfaas_prefix_wan_bytes_saved_total", "KV bytes suffix-only blobs left out (the prefix "
                           "the decode instance held), before the codec", ["role"], registry=PREFIX)
PREFIX_SUFFIX_BLOBS = Counter("prfaas_prefix_suffix_blobs_total", "Remote prefills asked for a suffix-only blob, by "
                              "outcome (sent; refused: decode no longer held the prefix, sent again whole)",
                              ["outcome"], registry=ROUTER)

_SERVED = {"router": (ROUTER,), "prefill": (PREFILL, STORE, DATA_PLANE, PREFIX),
           "decode": (DECODE, DATA_PLANE, PREFIX), "relay": (STORE,)}


def served(role: str, engine: str = "prfaas") -> tuple[CollectorRegistry, ...]:
    """The registries a process of ``role`` renders (see the module docstring); ``ValueError`` for an unknown role."""
    if role not in _SERVED:
        raise ValueError(f"unknown role {role!r}")
    return () if engine == "vllm" and role in ("prefill", "decode") else _SERVED[role]


def render(registries: tuple[CollectorRegistry, ...]) -> bytes:
    """The Prometheus text exposition of ``registries`` (no metric is in two of them, so no family repeats)."""
    return b"".join(generate_latest(registry) for registry in registries)


def names() -> set[str]:
    """Every metric family name prfaas defines (``_total`` of counters left off, as ``collect`` reports them)."""
    return {family.name for registry in REGISTRIES for family in registry.collect()}
