"""One configuration for every role: a YAML file (``--config`` or ``$PRFAAS_CONFIG``), then flags on top.

Keys are the source documents' parameter table plus the extra keys of docs/contracts.md (all of them, with their
defaults: docs/configuration.md). Every value is checked when the config is built; measured runtime values
(bandwidth, P99) live in runtime state, never here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from prfaas.errors import InvalidRequest
from prfaas.limits import WireLimits
from prfaas.tenancy.policy import Tenants
from prfaas.tls import TLSConfig


@dataclass(frozen=True)
class SLOConfig:
    ttft_p99_ms: float = 2000.0
    tpot_p99_ms: float = 200.0
    e2e_p99_ms: float = 20000.0


@dataclass(frozen=True)
class Config:
    kv_transfer_timeout_ms: int = 300
    kv_retry_budget: int = 2
    max_inflight_kv: int = 32
    chunk_size_kb: int = 1024
    serialization: str = "msgpack"
    checksum: str = "xxhash64"
    encryption: str = "tls1.3"
    kv_ttl_seconds: float = 120.0
    eviction_policy: str = "ttl+lru"
    rate_limit_qps: float = 1000.0
    degrade_p99_ms: float = 50.0
    success_rate_threshold: float = 0.999
    offload_threshold_tokens: int = 256
    fallback_local_prefill: bool = True
    decode_queue_limit: int = 16
    decode_queue_timeout_ms: int = 10000
    decode_max_batch: int = 32
    prefill_chunk_tokens: int = 512
    prefill_max_batch: int = 8  # prompts per batched prefill forward pass
    prefill_batch_tokens: int = 2048  # padded tokens per batched prefill forward pass
    heartbeat_interval_ms: int = 500
    heartbeat_timeout_ms: int = 3000
    store_budget_mb: int = 4096
    transfer_streams: int = 1
    kv_codec: str = "none"
    datacenter: str = ""
    api_keys: tuple[str, ...] = ()
    tls: TLSConfig = field(default_factory=TLSConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    limits: WireLimits = field(default_factory=WireLimits)  # what parsers accept (prfaas.limits)
    store_backend: str = "memory"  # where a relay's / prefill's KV blobs live: memory | redis
    redis_url: str = "redis://127.0.0.1:6379/0"  # store_backend redis; also unix:///path/redis.sock
    redis_maxmemory_policy: str = "noeviction"  # set on the Redis server at start; "" keeps the server's
    audit_log: str = ""  # hash-chained access/deletion log of each store; "{instance}" → instance id; "" = none
    drain_timeout_ms: int = 60000  # SIGTERM / `prfaas admin drain`: longest wait for in-flight work
    pools: dict[str, float] = field(default_factory=dict)  # model name or pool key → traffic weight (canary)
    pool_weights_file: str = ""  # the router keeps admin weight changes here across restarts; "" = memory only
    tenants: dict[str, Any] = field(default_factory=dict)  # tenant name → policy (prfaas.tenancy.policy)
    store_key_file: str = ""  # master key sealing blobs at rest (prfaas.store.sealed); also $PRFAAS_STORE_KEY
    redis_ca: str = ""  # CA bundle for a rediss:// redis_url; credentials in the URL or $PRFAAS_REDIS_PASSWORD

    def __post_init__(self) -> None:
        checks = [
            (60 <= self.kv_ttl_seconds <= 300, "kv_ttl_seconds must be within 60–300"),
            (64 <= self.chunk_size_kb <= 64 * 1024, "chunk_size_kb must be within 64–65536"),
            (self.kv_transfer_timeout_ms > 0, "kv_transfer_timeout_ms must be positive"),
            (0 <= self.kv_retry_budget <= 10, "kv_retry_budget must be within 0–10"),
            (self.max_inflight_kv >= 1, "max_inflight_kv must be at least 1"),
            (0 < self.success_rate_threshold <= 1, "success_rate_threshold must be within (0, 1]"),
            (self.offload_threshold_tokens >= 0, "offload_threshold_tokens must be ≥ 0"),
            (self.heartbeat_timeout_ms > self.heartbeat_interval_ms > 0,
             "heartbeat_timeout_ms must exceed heartbeat_interval_ms > 0"),
            (self.store_budget_mb >= 1, "store_budget_mb must be at least 1"),
            (self.decode_queue_timeout_ms >= 0, "decode_queue_timeout_ms must be ≥ 0"),
            (1 <= self.decode_max_batch <= 1024, "decode_max_batch must be within 1–1024"),
            (self.prefill_chunk_tokens >= 0, "prefill_chunk_tokens must be ≥ 0 (0: no chunking)"),
            (1 <= self.prefill_max_batch <= 256, "prefill_max_batch must be within 1–256"),
            (self.prefill_batch_tokens >= 1, "prefill_batch_tokens must be at least 1"),
            (self.rate_limit_qps > 0, "rate_limit_qps must be positive"),
            (1 <= self.transfer_streams <= 16, "transfer_streams must be within 1–16"),
            (self.serialization == "msgpack", "serialization: only msgpack is implemented"),
            (self.checksum == "xxhash64", "checksum: only xxhash64 is implemented"),
            (self.store_backend in ("memory", "redis"), "store_backend must be memory or redis"),
            (self.drain_timeout_ms >= 0, "drain_timeout_ms must be ≥ 0"),
            (all(w >= 0 for w in self.pools.values()), "pools: every weight must be ≥ 0"),
            (self.chunk_bytes <= self.limits.max_chunk_bytes, "chunk_size_kb must not exceed limits.max_chunk_bytes"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(f"config: {message}")
        Tenants.from_config(self.tenants)  # every tenant's policy within its limits, or refuse the config

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_size_kb * 1024

    @property
    def store_budget_bytes(self) -> int:
        return self.store_budget_mb * 1024 * 1024

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (flags over the file); ``None`` values are ignored."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """12 hex digits over the keys every instance of a deployment should share (not the per-host
        ``datacenter``, ``tls`` paths or ``api_keys``): `prfaas admin check` compares them across instances."""
        import hashlib
        import json

        shared = {k: v for k, v in self.to_dict().items()
                  if k not in ("datacenter", "tls", "api_keys", "store_key_file", "redis_ca")}
        return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:12]


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Config:
    """Read ``path`` (else ``$PRFAAS_CONFIG``, else defaults) and apply ``overrides``."""
    path = path or os.environ.get("PRFAAS_CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidRequest(f"cannot read config {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidRequest(f"config {path} must be a mapping of keys to values")
    return from_dict(data).replace(**overrides)


def from_dict(data: dict[str, Any]) -> Config:
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidRequest(f"config: unknown keys {unknown}; known keys are {sorted(known)}")
    values = dict(data)
    try:
        if "tls" in values:
            values["tls"] = TLSConfig(**(values["tls"] or {}))
        if "slo" in values:
            values["slo"] = SLOConfig(**(values["slo"] or {}))
        if "limits" in values:
            values["limits"] = WireLimits(**(values["limits"] or {}))
        if not isinstance(values.get("tenants") or {}, dict):
            raise InvalidRequest("config: tenants must be a mapping of tenant name to policy")
        if "api_keys" in values:
            values["api_keys"] = tuple(values["api_keys"] or ())
        return Config(**values)
    except TypeError as exc:
        raise InvalidRequest(f"config: {exc}") from exc
