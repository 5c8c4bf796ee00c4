"""Typed messages between roles (router ↔ prefill ↔ decode ↔ relay). JSON over HTTP on the control plane; the
KV itself travels on the binary data plane (``prfaas.transfer``). Each message validates what it is given."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, TypeVar

from prfaas import fields as check
from prfaas.errors import InvalidRequest
from prfaas.events import Stages

T = TypeVar("T", bound="Message")


# The messages' wire version: bumped with every field added to a message. A peer at a higher version may send
# fields this one does not know (they are its optional additions, dropped here); from a peer at this version or
# below, an unknown field is a mistake and is refused. So either side of a hop may be upgraded first.
WIRE_VERSION = 4  # 2: GenerateRequest's first_token, first_text, kv_tokens; 3: InstanceInfo's tcp_peers and
# prefix_blocks, GenerateRequest's tenant, ResponseMeta's kv_codec; 4: PrefillRequest's prefix_hash and
# prefix_tokens, ResponseMeta's kv_prefix_tokens
WIRE_KEY = "wire"


@dataclass(frozen=True)
class Message:
    """A JSON object on the wire, stamped with ``WIRE_VERSION``. ``from_json`` is strict: a field this version
    does not know is refused (``InvalidRequest`` naming it) unless the sender is newer (see ``WIRE_VERSION``), a
    missing required field too, and each message's ``__post_init__`` checks the types of its fields. A nested
    message (``nested``) travels as its own JSON object, under its parent's version, and is rebuilt typed."""

    nested: ClassVar[dict[str, type[Message]]] = {}

    def to_json(self) -> dict[str, Any]:
        return {**plain(self), WIRE_KEY: WIRE_VERSION}

    @classmethod
    def from_json(cls: type[T], data: Any, wire: int | None = None) -> T:
        """``wire``: the sender's version where ``data`` is nested in a message that carries it."""
        if not isinstance(data, dict):
            raise InvalidRequest(f"{cls.__name__} must be a JSON object")
        data = dict(data)
        sender = check.integer(data.pop(WIRE_KEY, 0 if wire is None else wire), WIRE_KEY, 0, 1 << 16)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown and sender <= WIRE_VERSION:
            raise InvalidRequest(f"{cls.__name__} has fields this version does not know: {unknown}", unknown[0])
        typed = {k: _nested(cls.nested[k], v, k, sender) if k in cls.nested else v
                 for k, v in data.items() if k in names}
        try:
            return cls(**typed)
        except TypeError as exc:  # a required field is missing
            raise InvalidRequest(f"bad {cls.__name__}: {exc}") from exc


_LEAVES = frozenset({str, int, float, bool, type(None)})


def plain(value: Any) -> Any:
    """``dataclasses.asdict`` without its ``copy.deepcopy`` of every leaf (milliseconds for a long prompt's token
    ids, paid on every hop of a request): containers and dataclasses are rebuilt, the immutable leaves messages
    hold (numbers, strings, booleans, None) are shared."""
    if type(value) in _LEAVES:
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(v if type(v) in _LEAVES else plain(v) for v in value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    return value


def _nested(kind: type[Message], value: Any, name: str, wire: int) -> Message:
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{name}' must be a JSON object", name)
    return kind.from_json(value, wire)


# The one set of sampling rules: the OpenAI parser and the internal /prefill and /generate bodies all build a
# SamplingParams, so a value refused at the router is refused the same by an instance, whoever sent it.
MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-3  # (0, this) is refused: it is argmax in all but exact ties; send 0 for greedy
MIN_TOP_P = 1e-9
SEED_BITS = 63
MAX_STOP = 4
MAX_TOKENS = 1 << 20  # above any context prfaas serves; the router also bounds it by the model's context


@dataclass(frozen=True)
class SamplingParams(Message):
    """temperature 0 is greedy; otherwise each step samples with a generator seeded by (seed, step), so prefill
    and decode on different hosts draw the same stream for the same request. ``InvalidRequest`` (400) for a value
    the sampler cannot serve: not a finite number, out of range, a temperature in (0, ``MIN_TEMPERATURE``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        temperature = check.number(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise InvalidRequest(f"'temperature' must be 0 (greedy) or within [{MIN_TEMPERATURE:g}, "
                                 f"{MAX_TEMPERATURE:g}], not {temperature!r}", "temperature")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", check.number(self.top_p, "top_p", MIN_TOP_P, 1.0))
        check.integer(self.seed, "seed", -(1 << SEED_BITS), (1 << SEED_BITS) - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_TCP_PEERS = 16  # TCP records in one heartbeat (``prfaas.transfer.stats.MAX_PEERS`` keeps as many)
MAX_RTT_MS = 600_000.0


@dataclass(frozen=True)
class TcpPeer(Message):
    """``TCP_INFO`` of an instance's data-plane connections to one peer data address (``HOST:PORT``): the last
    connection's smoothed RTT and the retransmitted segments summed (``prfaas.transfer.stats``). A decode instance
    reports the stores it pulled from, a prefill instance the relays it pushed to."""

    peer: str
    rtt_ms: float = 0.0
    retransmits: int = 0

    def __post_init__(self) -> None:
        check.text(self.peer, "peer", 300)
        object.__setattr__(self, "rtt_ms", check.number(self.rtt_ms, "rtt_ms", 0.0, MAX_RTT_MS))
        check.integer(self.retransmits, "retransmits", 0, 1 << 62)


def _tcp_peers(value: Any) -> list[TcpPeer]:
    """``InstanceInfo.tcp_peers`` rebuilt typed: a list of at most ``MAX_TCP_PEERS`` records, or ``InvalidRequest``."""
    if not isinstance(value, list) or len(value) > MAX_TCP_PEERS:
        raise InvalidRequest(f"'tcp_peers' must be a list of at most {MAX_TCP_PEERS} records", "tcp_peers")
    return [item if isinstance(item, TcpPeer) else TcpPeer.from_json(item, WIRE_VERSION) for item in value]


MAX_PREFIX_BLOCKS = 4096  # held blocks a heartbeat may name (senders keep fewer: prfaas.kv.prefix.SUMMARY_BLOCKS)


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
    model_root: str = ""  # the local directory its tokenizer loads from ("" for none): /v1/models' `root`
    max_seq_len: int = 0
    free_kv_bytes: int = 0
    kv_budget_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_fixed_bytes: int = 0
    queue_depth: int = 0
    ready: bool = True
    draining: bool = False  # finishing what it holds: placement gives it nothing new (prfaas.services.drain)
    config_hash: str = ""  # Config.fingerprint() of the instance's config, compared by `prfaas admin check`
    tcp_peers: list[TcpPeer] = field(default_factory=list)  # the router's per-link RTT (scheduler/links.py)
    # held prefix blocks (prfaas.kv.prefix.summary_key), most recent first: cache-aware placement (placement.py)
    prefix_blocks: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """A heartbeat's fields have their JSON types, or ``InvalidRequest`` (400): the registry, the scheduler and
        the metrics use them as numbers, flags and text."""
        for name in ("instance_id", "role", "url", "kv_address", "datacenter", "model", "model_root", "config_hash"):
            check.text(getattr(self, name), name)
        for name in ("max_seq_len", "queue_depth"):
            check.integer(getattr(self, name), name, 0, 1 << 62)
        for name in ("free_kv_bytes", "kv_budget_bytes", "kv_bytes_per_token", "kv_fixed_bytes"):
            check.integer(getattr(self, name), name, -(1 << 62), 1 << 62)
        check.boolean(self.ready, "ready")
        check.boolean(self.draining, "draining")
        if not isinstance(self.fingerprint, dict):
            raise InvalidRequest("'fingerprint' must be a JSON object", "fingerprint")
        object.__setattr__(self, "tcp_peers", _tcp_peers(self.tcp_peers))
        check.strings(self.prefix_blocks, "prefix_blocks", MAX_PREFIX_BLOCKS)
        if any(len(key) != 16 for key in self.prefix_blocks):
            raise InvalidRequest("'prefix_blocks' must hold 16-hex-digit block hashes", "prefix_blocks")

    def kv_bytes(self, tokens: int) -> int:
        """Expected KV bytes of a sequence of ``tokens`` on this instance (an upper bound for windowed layers)."""
        return self.kv_fixed_bytes + self.kv_bytes_per_token * tokens


@dataclass(frozen=True)
class PrefillRequest(Message):
    """router → prefill: prefill these tokens into the blob ``kv_id``; push it to ``push_to`` (relay mode)
    or keep it in the prefill's own store (direct mode, ``push_to`` empty)."""

    nested: ClassVar[dict[str, type[Message]]] = {"sampling": SamplingParams}

    request_id: str
    kv_id: str
    token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    push_to: str = ""
    deadline_ms: int = 0
    format_version: int = 0  # blob format to write, negotiated by the router for its readers; 0: the current
    tenant: str = ""  # whose blob: the store's records carry it (prfaas.tenancy)
    kv_codec: str = ""  # the tenant's codec override; "" = the prefill's kv_codec
    kv_ttl_seconds: float = 0.0  # the tenant's TTL override for the blob; 0 = the store's
    # the decode instance holds the prompt's first prefix_tokens (a block boundary), whose last block's chain hash
    # under its salt is prefix_hash (32 hex digits): ship only the rest (docs/prefix-cache.md); 0: the whole prompt
    prefix_hash: str = ""
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("request_id", "kv_id", "push_to", "tenant", "kv_codec", "prefix_hash"):
            check.text(getattr(self, name), name)
        check.token_ids(self.token_ids, "token_ids")
        _check_sampling(self.sampling)
        check.integer(self.deadline_ms, "deadline_ms", 0, 1 << 62)
        check.integer(self.format_version, "format_version", 0, 1 << 16)
        check.number(self.kv_ttl_seconds, "kv_ttl_seconds", 0.0, float(1 << 32))
        check.integer(self.prefix_tokens, "prefix_tokens", 0, max(0, len(self.token_ids) - 1))
        if bool(self.prefix_tokens) != bool(self.prefix_hash) or (self.prefix_hash and (
                len(self.prefix_hash) != 32 or set(self.prefix_hash) - set("0123456789abcdef"))):
            raise InvalidRequest("prefix_hash must be 32 hex digits exactly when prefix_tokens is set",
                                 "prefix_hash")


@dataclass(frozen=True)
class GenerateRequest(Message):
    """router → decode. With ``kv_id`` the KV is pulled from ``kv_address``; without, decode prefills locally.
    ``first_token`` (-1: not known), ``first_text`` and ``kv_tokens``: what a prefill on vLLM said at ``accepted``
    (``prfaas.events.Accepted``); vLLM's decode streams that token at once and computes from the next one, with
    the blob covering ``kv_tokens`` prompt tokens. prfaas's engine ignores them (its blob carries the token)."""

    nested: ClassVar[dict[str, type[Message]]] = {"sampling": SamplingParams}

    request_id: str
    token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    kv_id: str = ""
    kv_address: str = ""
    deadline_ms: int = 0
    step_offset: int = 0  # tokens already streamed by an instance that died: sampling continues at this step
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    first_token: int = -1
    first_text: str = ""
    kv_tokens: int = 0
    tenant: str = ""  # whose prompt: a local prefill reuses only this tenant's cached prefixes

    def __post_init__(self) -> None:
        for name in ("request_id", "kv_id", "kv_address", "first_text", "tenant"):
            check.text(getattr(self, name), name)
        check.integer(self.first_token, "first_token", -1, 1 << 31)
        check.integer(self.kv_tokens, "kv_tokens", 0, MAX_TOKENS)
        check.token_ids(self.token_ids, "token_ids")
        check.integer(self.max_tokens, "max_tokens", 1, MAX_TOKENS)
        _check_sampling(self.sampling)
        check.strings(self.stop, "stop", MAX_STOP)
        check.integer(self.deadline_ms, "deadline_ms", 0, 1 << 62)
        check.integer(self.step_offset, "step_offset", 0, MAX_TOKENS)
        check.boolean(self.ignore_eos, "ignore_eos")


def _check_sampling(value: Any) -> None:
    if not isinstance(value, SamplingParams):
        raise InvalidRequest("'sampling' must be a JSON object of sampling parameters", "sampling")


@dataclass(frozen=True)
class TokenizeRequest:
    """router → decode ``/tokenize``: a completion's ``prompt`` (text or token ids) or a chat's ``messages`` as the
    client sent them; the decode instance's tokenizer and chat template make the token ids. Its wire form is those
    OpenAI fields alone, which the decode instance checks itself."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"messages": self.messages} if self.messages is not None else {"prompt": self.prompt}


@dataclass
class ResponseMeta:
    """The ``prfaas`` field of a router's response (docs/contracts.md), filled in by the router as the request runs:
    ``route`` and ``reason`` at the routing decision, the pull's ``stages`` and ``ttft_ms`` at the first token,
    the prefill's ``kv_bytes`` and stages at the end. ``to_json`` leaves out what was never known."""

    tenant: str = ""
    pool: str | None = None
    model: str | None = None
    route: str | None = None
    reason: str | None = None
    reason_code: str | None = None
    decode_instance: str | None = None
    retries: int = 0
    fallback: bool = False
    kv_id: str | None = None
    prefill_instance: str | None = None
    kv_bytes: int | None = None
    transfer_ms: float | None = None
    ttft_ms: float | None = None
    stages: Stages | None = None
    resumed_on: str | None = None
    kv_codec: str | None = None  # a lossy codec the router chose for this request's link (docs/scheduling.md)
    kv_prefix_tokens: int | None = None  # the blob was suffix-only: it extended this many tokens decode held

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if self.stages is not None:
            out["stages"] = self.stages.to_json()
        return out

    def add_stages(self, stages: Stages) -> None:
        self.stages = (self.stages or Stages()).merged(stages.rounded())
