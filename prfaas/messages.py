"""Typed messages between roles (router ↔ prefill ↔ decode ↔ relay). JSON over HTTP on the control plane; the
KV itself travels on the binary data plane (``prfaas.transfer``). Each message validates what it is given."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from prfaas.errors import InvalidRequest

T = TypeVar("T", bound="Message")


@dataclass(frozen=True)
class Message:
    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls: type[T], data: Any) -> T:
        if not isinstance(data, dict):
            raise InvalidRequest(f"{cls.__name__} must be a JSON object")
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise InvalidRequest(f"bad {cls.__name__}: {exc}") from exc


@dataclass(frozen=True)
class SamplingParams(Message):
    """temperature 0 is greedy; otherwise each step samples with a generator seeded by (seed, step), so prefill
    and decode on different hosts draw the same stream for the same request."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 5.0:
            raise InvalidRequest("temperature must be within [0, 5]")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must be within (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class InstanceInfo(Message):
    """What an instance registers with the router, and refreshes with every heartbeat."""

    instance_id: str
    role: str
    url: str
    kv_address: str = ""
    datacenter: str = ""
    fingerprint: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    max_seq_len: int = 0
    free_kv_bytes: int = 0
    kv_budget_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_fixed_bytes: int = 0
    queue_depth: int = 0
    ready: bool = True
    draining: bool = False  # finishing what it holds: placement gives it nothing new (prfaas.services.drain)
    config_hash: str = ""  # Config.fingerprint() of the instance's config, compared by `prfaas admin check`

    def kv_bytes(self, tokens: int) -> int:
        """Expected KV bytes of a sequence of ``tokens`` on this instance (an upper bound for windowed layers)."""
        return self.kv_fixed_bytes + self.kv_bytes_per_token * tokens


@dataclass(frozen=True)
class PrefillRequest(Message):
    """router → prefill: prefill these tokens into the blob ``kv_id``; push it to ``push_to`` (relay mode)
    or keep it in the prefill's own store (direct mode, ``push_to`` empty)."""

    request_id: str
    kv_id: str
    token_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    push_to: str = ""
    deadline_ms: int = 0
    format_version: int = 0  # blob format to write, negotiated by the router for its readers; 0: the current
    tenant: str = ""  # whose blob: the store's records carry it (prfaas.tenancy)
    kv_codec: str = ""  # the tenant's codec override; "" = the prefill's kv_codec
    kv_ttl_seconds: float = 0.0  # the tenant's TTL override for the blob; 0 = the store's


@dataclass(frozen=True)
class GenerateRequest(Message):
    """router → decode. With ``kv_id`` the KV is pulled from ``kv_address``; without, decode prefills locally."""

    request_id: str
    token_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    kv_id: str = ""
    kv_address: str = ""
    deadline_ms: int = 0
    step_offset: int = 0  # tokens already streamed by an instance that died: sampling continues at this step
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
