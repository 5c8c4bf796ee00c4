"""One configuration for every role: a YAML file (``--config`` or ``$PRFAAS_CONFIG``), then flags on top.

Keys are the source documents' parameter table plus the extra keys of docs/contracts.md (all of them, with their
defaults: docs/configuration.md). The file stays flat; ``from_dict`` sorts its keys into frozen per-concern
sections (``TransferConfig``, ``StoreConfig``, ``RouterConfig``, ``PrefillConfig``, ``DecodeConfig``,
``CommonConfig``) under one frozen root, so each role is handed the sections it reads and nothing else. Every value
is checked when its section is built; measured runtime values (bandwidth, P99) live in runtime state, never here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Generic, TypeVar, get_origin, get_type_hints

import yaml

from prfaas.errors import InvalidRequest
from prfaas.limits import WireLimits
from prfaas.tenancy.clusters import parse_clusters
from prfaas.tenancy.policy import Tenants
from prfaas.tls import TLSConfig

T = TypeVar("T")


def _refuse_unless(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise InvalidRequest(f"config: {message}")


@dataclass(frozen=True)
class SLOConfig:
    ttft_p99_ms: float = 2000.0
    tpot_p99_ms: float = 200.0
    e2e_p99_ms: float = 20000.0


@dataclass(frozen=True)
class TransferConfig:
    """How KV blobs cross a hop: read by prefill (push/write) and decode (pull)."""

    kv_transfer_timeout_ms: int = 300
    kv_retry_budget: int = 2
    max_inflight_kv: int = 32
    chunk_size_kb: int = 1024
    serialization: str = "msgpack"
    checksum: str = "xxhash64"
    encryption: str = "tls1.3"
    transfer_streams: int = 1
    kv_codec: str = "none"

    def __post_init__(self) -> None:
        _refuse_unless([
            (64 <= self.chunk_size_kb <= 64 * 1024, "chunk_size_kb must be within 64–65536"),
            (self.kv_transfer_timeout_ms > 0, "kv_transfer_timeout_ms must be positive"),
            (0 <= self.kv_retry_budget <= 10, "kv_retry_budget must be within 0–10"),
            (self.max_inflight_kv >= 1, "max_inflight_kv must be at least 1"),
            (1 <= self.transfer_streams <= 16, "transfer_streams must be within 1–16"),
            (self.serialization == "msgpack", "serialization: only msgpack is implemented"),
            (self.checksum == "xxhash64", "checksum: only xxhash64 is implemented"),
        ])

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_size_kb * 1024


@dataclass(frozen=True)
class StoreConfig:
    """Where a relay's / prefill's KV blobs live and for how long, and the audit log of each store (or, for a
    process without a store, of its own refusals)."""

    kv_ttl_seconds: float = 120.0
    eviction_policy: str = "ttl+lru"
    store_budget_mb: int = 4096  # on decode: its KV memory budget
    store_backend: str = "memory"  # memory | redis
    redis_url: str = "redis://127.0.0.1:6379/0"  # store_backend redis; also unix:///path/redis.sock
    redis_maxmemory_policy: str = "noeviction"  # set on the Redis server at start; "" keeps the server's
    redis_ca: str = ""  # CA bundle for a rediss:// redis_url; credentials in the URL or $PRFAAS_REDIS_PASSWORD
    audit_log: str = ""  # hash-chained access/deletion log of each store; "{instance}" → instance id; "" = none
    store_key_file: str = ""  # master key sealing blobs at rest (prfaas.store.sealed); also $PRFAAS_STORE_KEY

    def __post_init__(self) -> None:
        _refuse_unless([
            (60 <= self.kv_ttl_seconds <= 300, "kv_ttl_seconds must be within 60–300"),
            (self.store_budget_mb >= 1, "store_budget_mb must be at least 1"),
            (self.store_backend in ("memory", "redis"), "store_backend must be memory or redis"),
        ])

    @property
    def store_budget_bytes(self) -> int:
        return self.store_budget_mb * 1024 * 1024


@dataclass(frozen=True)
class RouterConfig:
    """The router's routing, admission and pool choices (including what it waits for from decode instances)."""

    rate_limit_qps: float = 1000.0
    degrade_p99_ms: float = 50.0
    success_rate_threshold: float = 0.999
    offload_threshold_tokens: int = 256
    fallback_local_prefill: bool = True
    local_tokenizer: bool = True  # tokenise here where the decode instances' tokenizer files are readable
    decode_queue_limit: int = 16
    decode_queue_timeout_ms: int = 10000
    pools: dict[str, float] = field(default_factory=dict)  # model name or pool key → traffic weight (canary)
    pool_weights_file: str = ""  # the router keeps admin weight changes here across restarts; "" = memory only
    cluster: str = ""  # this router's client cluster of a shared prefill pool (an entry of `clusters`); "" = none
    offload_policy: str = "threshold"  # threshold | cost (docs/scheduling.md); the threshold is cost's floor
    link_share: float = 0.7  # the share of a link's bandwidth KV may use (the 70 % rule, online)
    link_bandwidth_bps: float = 1e9  # each link's provisioned bandwidth, until its transfers show less
    prefill_profile: str = ""  # speed profile (`prfaas measure`) of remote prefill, for the cost model
    local_profile: str = ""  # speed profile of local prefill on decode instances, for the cost model
    adaptive_codec: dict[str, Any] = field(default_factory=dict)  # link-adaptive lossy codecs; {} = off
    slo: SLOConfig = field(default_factory=SLOConfig)

    def __post_init__(self) -> None:
        _refuse_unless([(isinstance(self.pools, dict) and all(
            isinstance(w, int | float) and not isinstance(w, bool) for w in self.pools.values()),
            "pools must be a mapping of model name or pool key to a weight (a number)")])
        _refuse_unless([
            (0 < self.success_rate_threshold <= 1, "success_rate_threshold must be within (0, 1]"),
            (self.offload_threshold_tokens >= 0, "offload_threshold_tokens must be ≥ 0"),
            (self.decode_queue_timeout_ms >= 0, "decode_queue_timeout_ms must be ≥ 0"),
            (self.rate_limit_qps > 0, "rate_limit_qps must be positive"),
            (all(w >= 0 for w in self.pools.values()), "pools: every weight must be ≥ 0"),
            (self.offload_policy in ("threshold", "cost"), "offload_policy must be threshold or cost"),
            (0 < self.link_share <= 1, "link_share must be within (0, 1]"),
            (self.link_bandwidth_bps > 0, "link_bandwidth_bps must be positive"),
        ])


@dataclass(frozen=True)
class PrefillConfig:
    """How a prefill pass is cut and batched (``prefill_chunk_tokens`` also cuts decode's local prefill while other
    sequences run on that instance)."""

    prefill_chunk_tokens: int = 512
    prefill_max_batch: int = 8  # prompts per batched prefill forward pass
    prefill_batch_tokens: int = 2048  # padded tokens per batched prefill forward pass
    prefix_cache_mb: int = 0  # the engine's prefix cache (docs/prefix-cache.md), on prefill and decode; 0 = off
    prefix_cache_ttl_s: float = 600.0  # a cached prefix is deleted this long after its store (hits do not extend it)

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefix_cache_mb * 1024 * 1024

    def __post_init__(self) -> None:
        _refuse_unless([
            (self.prefix_cache_mb >= 0, "prefix_cache_mb must be ≥ 0 (0: no prefix cache)"),
            (1 <= self.prefix_cache_ttl_s <= 86400, "prefix_cache_ttl_s must be within 1–86400"),
            (self.prefill_chunk_tokens >= 0, "prefill_chunk_tokens must be ≥ 0 (0: no chunking)"),
            (1 <= self.prefill_max_batch <= 256, "prefill_max_batch must be within 1–256"),
            (self.prefill_batch_tokens >= 1, "prefill_batch_tokens must be at least 1"),
        ])


@dataclass(frozen=True)
class DecodeConfig:
    """How a decode instance batches its sequences."""

    decode_max_batch: int = 32

    def __post_init__(self) -> None:
        _refuse_unless([(1 <= self.decode_max_batch <= 1024, "decode_max_batch must be within 1–1024")])


@dataclass(frozen=True)
class CommonConfig:
    """What every process reads whatever its role: where it runs, its keys, heartbeats and drain."""

    datacenter: str = ""
    api_keys: tuple[Any, ...] = ()  # key strings or mappings (prfaas.security.apikeys)
    heartbeat_interval_ms: int = 500
    heartbeat_timeout_ms: int = 3000
    drain_timeout_ms: int = 60000  # SIGTERM / `prfaas admin drain`: longest wait for in-flight work

    def __post_init__(self) -> None:
        _refuse_unless([
            (self.heartbeat_timeout_ms > self.heartbeat_interval_ms > 0,
             "heartbeat_timeout_ms must exceed heartbeat_interval_ms > 0"),
            (self.drain_timeout_ms >= 0, "drain_timeout_ms must be ≥ 0"),
        ])


SECTIONS: dict[str, type] = {"transfer": TransferConfig, "store": StoreConfig, "router": RouterConfig,
                             "prefill": PrefillConfig, "decode": DecodeConfig, "common": CommonConfig}
WHOLE = ("tls", "limits", "tenants", "clusters")  # keys that are a value of the root itself, shared by several roles
SECTION_OF: dict[str, str] = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}


class _Flat(Generic[T]):
    """A read-only ``config.<key>`` alias of ``config.<section>.<key>``: kept so prfaas/vllm and older callers
    read the flat names; prfaas's own roles read their sections."""

    def __init__(self, section: str) -> None:
        self.section = section
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]  # the class attribute itself
        return getattr(getattr(obj, self.section), self.name)


@dataclass(frozen=True)
class Config:
    """The root: one frozen section per concern plus the values several roles share (``tls``, ``limits``,
    ``tenants``). Build it from the flat keys with ``from_dict`` / ``load_config``."""

    transfer: TransferConfig = field(default_factory=TransferConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    common: CommonConfig = field(default_factory=CommonConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)
    limits: WireLimits = field(default_factory=WireLimits)  # what parsers accept (prfaas.limits)
    tenants: dict[str, Any] = field(default_factory=dict)  # tenant name → policy (prfaas.tenancy.policy)
    clusters: dict[str, Any] = field(default_factory=dict)  # client cluster → entry (prfaas.tenancy.clusters)

    # Flat read-only aliases (see _Flat); every key of every section has one.
    kv_transfer_timeout_ms = _Flat[int]("transfer")
    kv_retry_budget = _Flat[int]("transfer")
    max_inflight_kv = _Flat[int]("transfer")
    chunk_size_kb = _Flat[int]("transfer")
    serialization = _Flat[str]("transfer")
    checksum = _Flat[str]("transfer")
    encryption = _Flat[str]("transfer")
    transfer_streams = _Flat[int]("transfer")
    kv_codec = _Flat[str]("transfer")
    chunk_bytes = _Flat[int]("transfer")
    kv_ttl_seconds = _Flat[float]("store")
    eviction_policy = _Flat[str]("store")
    store_budget_mb = _Flat[int]("store")
    store_backend = _Flat[str]("store")
    redis_url = _Flat[str]("store")
    redis_maxmemory_policy = _Flat[str]("store")
    redis_ca = _Flat[str]("store")
    audit_log = _Flat[str]("store")
    store_key_file = _Flat[str]("store")
    store_budget_bytes = _Flat[int]("store")
    rate_limit_qps = _Flat[float]("router")
    degrade_p99_ms = _Flat[float]("router")
    success_rate_threshold = _Flat[float]("router")
    offload_threshold_tokens = _Flat[int]("router")
    fallback_local_prefill = _Flat[bool]("router")
    local_tokenizer = _Flat[bool]("router")
    decode_queue_limit = _Flat[int]("router")
    decode_queue_timeout_ms = _Flat[int]("router")
    pools = _Flat[dict[str, float]]("router")
    pool_weights_file = _Flat[str]("router")
    cluster = _Flat[str]("router")
    offload_policy = _Flat[str]("router")
    link_share = _Flat[float]("router")
    link_bandwidth_bps = _Flat[float]("router")
    prefill_profile = _Flat[str]("router")
    local_profile = _Flat[str]("router")
    adaptive_codec = _Flat[dict[str, Any]]("router")
    slo = _Flat[SLOConfig]("router")
    prefill_chunk_tokens = _Flat[int]("prefill")
    prefill_max_batch = _Flat[int]("prefill")
    prefill_batch_tokens = _Flat[int]("prefill")
    prefix_cache_mb = _Flat[int]("prefill")
    prefix_cache_ttl_s = _Flat[float]("prefill")
    decode_max_batch = _Flat[int]("decode")
    datacenter = _Flat[str]("common")
    api_keys = _Flat[tuple[Any, ...]]("common")
    heartbeat_interval_ms = _Flat[int]("common")
    heartbeat_timeout_ms = _Flat[int]("common")
    drain_timeout_ms = _Flat[int]("common")

    def __post_init__(self) -> None:
        _refuse_unless([(self.transfer.chunk_bytes <= self.limits.max_chunk_bytes,
                         "chunk_size_kb must not exceed limits.max_chunk_bytes")])
        Tenants.from_config(self.tenants)  # every tenant's policy within its limits, or refuse the config
        parse_clusters(self.clusters)  # every client cluster's entry within its limits (the router checks its own)

    def replace(self, **changes: Any) -> Config:
        """A copy with the flat-key ``changes`` applied (flags over the file); ``None`` values are ignored."""
        changes = {k: v for k, v in changes.items() if v is not None}
        _refuse_unknown(changes)
        root = {k: changes[k] for k in WHOLE if k in changes}
        for name in SECTIONS:
            mine = {k: v for k, v in changes.items() if SECTION_OF.get(k) == name}
            if mine:
                root[name] = dataclasses.replace(getattr(self, name), **mine)
        return dataclasses.replace(self, **root)

    def to_dict(self) -> dict[str, Any]:
        """The flat keys of the YAML file, with their values."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out | {"tls": dataclasses.asdict(self.tls), "limits": dataclasses.asdict(self.limits),
                      "tenants": self.tenants, "clusters": self.clusters}

    def digest(self) -> str:
        """12 hex digits over the keys every instance of a deployment should share (not the per-host
        ``datacenter``, ``tls`` paths, ``api_keys`` or a pool's ``clusters``, whose keys each router holds only its own
        of): `prfaas admin check` compares them across instances."""
        import hashlib
        import json

        shared = {k: v for k, v in self.to_dict().items()
                  if k not in ("datacenter", "tls", "api_keys", "store_key_file", "redis_ca", "clusters", "cluster")}
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


def _refuse_unknown(data: dict[str, Any]) -> None:
    known = set(SECTION_OF) | set(WHOLE)
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidRequest(f"config: unknown keys {unknown}; known keys are {sorted(known)}")


def _nested(cls: type[T], value: Any) -> T:
    """A nested mapping (``tls``, ``slo``, ``limits``) as its dataclass; an already built one as it is."""
    return value if isinstance(value, cls) else cls(**(value or {}))


_KINDS: dict[type, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "true or false"), int: ((int,), "an integer"), float: ((int, float), "a number"),
    str: ((str,), "a string"), dict: ((dict,), "a mapping"), tuple: ((tuple,), "a list")}


def _check_types(values: dict[str, Any]) -> None:
    """Each flat key's value has its field's type (a bool is not a number; an int is a float)."""
    for name, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for key in (k for k in values if SECTION_OF.get(k) == name):
            kind = get_origin(hints[key]) or hints[key]
            if kind not in _KINDS:
                continue  # a nested dataclass (slo), checked when it is built
            accepted, what = _KINDS[kind]
            value = values[key]
            if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
                raise InvalidRequest(f"config: {key} must be {what}, not {type(value).__name__}")


def from_dict(data: dict[str, Any]) -> Config:
    """The root config from the flat keys of the YAML file; ``InvalidRequest`` naming the key for an unknown key,
    a wrong type or an out-of-range value."""
    _refuse_unknown(data)
    values = dict(data)
    try:
        if "slo" in values:
            values["slo"] = _nested(SLOConfig, values["slo"])
        if "api_keys" in values:
            if not isinstance(values["api_keys"] or (), list | tuple):
                raise InvalidRequest("config: api_keys must be a list of keys")
            values["api_keys"] = tuple(values["api_keys"] or ())
        _check_types(values)
        if not isinstance(values.get("tenants") or {}, dict):
            raise InvalidRequest("config: tenants must be a mapping of tenant name to policy")
        if not isinstance(values.get("clusters") or {}, dict):
            raise InvalidRequest("config: clusters must be a mapping of cluster name to its entry")
        sections = {name: cls(**{k: v for k, v in values.items() if SECTION_OF.get(k) == name})
                    for name, cls in SECTIONS.items()}
        return Config(**sections, tls=_nested(TLSConfig, values.get("tls")),
                      limits=_nested(WireLimits, values.get("limits")), tenants=values.get("tenants") or {},
                      clusters=values.get("clusters") or {})
    except TypeError as exc:
        raise InvalidRequest(f"config: {exc}") from exc
