"""The events of the two streams between roles, and their one codec.

    router → prefill  POST /prefill   Accepted, then PrefillDone or Failed
    router → decode   POST /generate  Token ..., then Done; or Failed at any point

Each event is one NDJSON line, a JSON object tagged by ``event``: ``accepted``, ``token``, ``done``, ``error``.
Both streams end with a ``done`` of their own shape, so a reader decodes with the stream's own decoder
(``prefill_event``, ``generate_event``). Decoding is strict: a line that is not JSON, an unknown tag, a missing
field, a field of the wrong type or a field this version does not know is ``KVBadFormat`` (a peer that breaks the
stream's format is at fault, not the request). Ground floor: imports nothing of prfaas but its errors.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, ClassVar, TypeVar

from prfaas.errors import KVBadFormat, KVUnavailable, PrfaasError, error_from_code

E = TypeVar("E", bound="Event")


@dataclass(frozen=True)
class Stages:
    """Milliseconds per stage of a request, each where known: on decode's first token (the pull's ``transfer_ms``,
    ``restore_ms``, or a local prefill's ``queue_ms``/``prefill_ms``; vLLM's ``decode_ms``), and in the router's
    response field (``prfaas.messages.ResponseMeta``)."""

    queue_ms: float | None = None
    prefill_ms: float | None = None
    transfer_ms: float | None = None
    restore_ms: float | None = None
    decode_ms: float | None = None

    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, data: Any) -> Stages:
        obj = _object(data, "stages", {f.name for f in fields(cls)})
        return cls(**{name: _number(value, name) for name, value in obj.items()})

    def merged(self, other: Stages) -> Stages:
        """These stages, with each one ``other`` knows taken from it."""
        return Stages(**{f.name: _first(getattr(other, f.name), getattr(self, f.name)) for f in fields(self)})

    def rounded(self) -> Stages:
        return Stages(**{f.name: None if getattr(self, f.name) is None else round(getattr(self, f.name), 2)
                         for f in fields(self)})


@dataclass(frozen=True)
class Event:
    tag: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"event": self.tag}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Stages):
                value = value.to_json()
            if value is not None:
                out[f.name] = value
        return out

    def encode(self) -> bytes:
        """The event's NDJSON line."""
        return (json.dumps(self.to_json()) + "\n").encode()


@dataclass(frozen=True)
class Accepted(Event):
    """prefill: the blob exists where decode reads it; decode may start pulling. An engine that accepts only once
    its prefill is over (vLLM) may say the first token there: ``first_token``, its ``first_text``, and
    ``kv_tokens``, the prompt tokens the blob covers (all of them: the token is the answer's first). The router
    hands them to decode, which streams that token at once instead of computing it again (``GenerateRequest``)."""

    tag: ClassVar[str] = "accepted"
    first_token: int | None = None
    first_text: str | None = None
    kv_tokens: int | None = None


@dataclass(frozen=True)
class PrefillDone(Event):
    """prefill: the blob is complete (its trailer written)."""

    tag: ClassVar[str] = "done"
    first_token: int
    kv_bytes: int
    chunks: int
    prefill_ms: float
    queue_ms: float


@dataclass(frozen=True)
class Token(Event):
    """decode: one generated token id and the text it completes (may be ""); the first carries ``stages``."""

    tag: ClassVar[str] = "token"
    token: int
    text: str = ""
    stages: Stages | None = None


@dataclass(frozen=True)
class Done(Event):
    """decode: the sequence ended (``stop`` or ``length``); ``text`` is what the stop matcher still held.
    ``recomputed``: prompt tokens decode computed itself although it was sent their KV (the KV could not be used:
    vLLM's connector recomputes the prompt after a failed pull), so the prompt was in fact prefilled locally."""

    tag: ClassVar[str] = "done"
    finish_reason: str
    completion_tokens: int
    text: str = ""
    recomputed: int = 0


@dataclass(frozen=True)
class Failed(Event):
    """Either stream: the request failed with the wire ``code`` of ``prfaas.errors``; nothing follows."""

    tag: ClassVar[str] = "error"
    code: str
    message: str = ""

    @classmethod
    def of(cls, exc: PrfaasError) -> Failed:
        return cls(**exc.to_wire())

    def error(self) -> PrfaasError:
        """The exception the peer reported (the base class for a code this version does not know)."""
        return error_from_code(self.code or KVUnavailable.code, self.message)


PrefillEvent = Accepted | PrefillDone | Failed
GenerateEvent = Token | Done | Failed
FINISH_REASONS = ("stop", "length")


def prefill_event(line: str | bytes) -> PrefillEvent:
    """One line of a /prefill stream; ``KVBadFormat`` for anything but a well-formed event of that stream."""
    return _decode(line, (Accepted, PrefillDone, Failed))  # type: ignore[return-value]


def generate_event(line: str | bytes) -> GenerateEvent:
    """One line of a /generate stream; ``KVBadFormat`` for anything but a well-formed event of that stream."""
    event = _decode(line, (Token, Done, Failed))
    if isinstance(event, Done) and event.finish_reason not in FINISH_REASONS:
        raise KVBadFormat(f"'finish_reason' must be one of {FINISH_REASONS}, not {event.finish_reason!r}")
    return event  # type: ignore[return-value]


def _decode(line: str | bytes, kinds: tuple[type[Event], ...]) -> Event:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise KVBadFormat(f"a stream line is not JSON: {str(line)[:80]!r}") from exc
    tag = data.get("event") if isinstance(data, dict) else None
    kind = next((k for k in kinds if k.tag == tag), None)
    if kind is None:
        raise KVBadFormat(f"unexpected stream event {tag!r}; this stream carries {[k.tag for k in kinds]}")
    return _build(kind, data)


def _build(kind: type[E], data: dict[str, Any]) -> E:
    known = {f.name: f for f in fields(kind)}
    body = _object({k: v for k, v in data.items() if k != "event"}, kind.tag, set(known))
    missing = [name for name, f in known.items() if name not in body and _required(f)]
    if missing:
        raise KVBadFormat(f"a {kind.tag!r} event lacks {missing}")
    return kind(**{name: _typed(known[name].type, value, name) for name, value in body.items()})


def _required(f: Field[Any]) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _typed(annotation: Any, value: Any, name: str) -> Any:
    """``value`` checked against the field's annotation (a string, since annotations are postponed)."""
    kind = str(annotation)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise KVBadFormat(f"'{name}' must be an integer, not {value!r}")
        return value
    if kind == "float":
        return _number(value, name)
    if kind == "str":
        if not isinstance(value, str):
            raise KVBadFormat(f"'{name}' must be a string, not {value!r}")
        return value
    if kind in ("int | None", "str | None"):
        return _typed(kind.removesuffix(" | None"), value, name)
    if kind == "Stages | None":
        return Stages.from_json(value)
    raise TypeError(f"no codec for {kind}")  # a field added to an event without a codec: a bug here


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise KVBadFormat(f"'{name}' must be a finite number, not {value!r}")
    return float(value)


def _object(data: Any, what: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise KVBadFormat(f"{what} must be a JSON object")
    unknown = sorted(set(data) - known)
    if unknown:
        raise KVBadFormat(f"{what} has fields this version does not know: {unknown}")
    return data


def _first(a: float | None, b: float | None) -> float | None:
    return a if a is not None else b
