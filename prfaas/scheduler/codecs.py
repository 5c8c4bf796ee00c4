"""Link-adaptive compression: which lossy KV codecs the router may ask for, per tenant and per model.

Off unless ``adaptive_codec`` is configured::

    adaptive_codec:
      min_agreement: 0.99              # a codec is used only where its measured agreement is at least this
      agreement:                       # model → codec → measured greedy-token agreement
        smollm2-135m: {int8: 1.0, fp8: 0.994, int4: 0.970}   # benchmarks/kv_codecs.py's quality table
      tenants:                         # tenant → the codecs it accepts ("*": any tenant)
        default: [int8, fp8]

When the link, not compute, decided that a request stays local (``cost_transfer`` or ``link_busy``), the
``Scheduler`` tries the allowed codecs, highest agreement first, and routes the request remote with the first one
whose smaller blob makes the remote route win within the link's budget (reason code ``link_codec``; the response's
``kv_codec`` names it). A codec with no measured agreement for the model, or no measured size in the speed
profile, is never chosen: nothing is assumed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prfaas.errors import InvalidRequest

LOSSY = ("bf16", "fp8", "int8", "int4")  # prfaas.kv.codecs.CODECS but "none" (kept import-light here)
_KEYS = {"min_agreement", "agreement", "tenants"}


@dataclass(frozen=True)
class CodecPolicy:
    min_agreement: float = 1.0
    agreement: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    tenants: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def allowed(self, tenant: str, model: str) -> list[tuple[str, float]]:
        """``(codec, agreement)`` pairs the tenant accepts and the model's measurements allow, best first."""
        accepted = self.tenants.get(tenant, self.tenants.get("*", ()))
        measured = self.agreement.get(model, {})
        pairs = [(c, measured[c]) for c in accepted if c in measured and measured[c] >= self.min_agreement]
        return sorted(pairs, key=lambda p: (-p[1], p[0]))


def parse_codecs(spec: Mapping[str, Any]) -> CodecPolicy | None:
    """The policy from the ``adaptive_codec`` mapping; ``None`` when it is empty (off); ``InvalidRequest`` naming
    the field otherwise."""
    if not spec:
        return None
    if set(spec) - _KEYS:
        raise InvalidRequest(f"adaptive_codec: unknown keys {sorted(set(spec) - _KEYS)}; known: {sorted(_KEYS)}")
    try:
        floor = float(spec.get("min_agreement", 1.0))
        agreement = {str(m): {_codec(c): float(v) for c, v in dict(codecs).items()}
                     for m, codecs in dict(spec.get("agreement") or {}).items()}
        tenants = {str(t): tuple(_codec(c) for c in list(codecs)) for t, codecs in dict(spec.get("tenants") or
                                                                                         {}).items()}
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"adaptive_codec: {exc}") from exc
    if not 0 <= floor <= 1 or any(not 0 <= v <= 1 for codecs in agreement.values() for v in codecs.values()):
        raise InvalidRequest("adaptive_codec: agreements and min_agreement are fractions within [0, 1]")
    return CodecPolicy(floor, agreement, tenants)


def _codec(name: Any) -> str:
    if name not in LOSSY:
        raise ValueError(f"{name!r} is not a lossy codec ({', '.join(LOSSY)})")
    return str(name)
