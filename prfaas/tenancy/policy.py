"""Per-tenant policy, from the ``tenants`` config key::

    tenants:
      acme:                               # a tenant name: [a-z0-9_-], at most 64 characters
        allowed_datacenters: [dc-b]       # where its KV may be computed or held; [] = anywhere
        prompt_may_cross: false           # may its prompt (text or token ids) leave the router's datacenter
        kv_codec: int8                    # overrides kv_codec for its blobs (any codec)
        kv_ttl_seconds: 60                # overrides kv_ttl_seconds, within the same 60-300 s limits
        rate_limit_qps: 5                 # its own token bucket, on top of the cluster's
        redact: mask_identifiers          # a redaction hook (prfaas.tenancy.redact), by name or module:function

API keys name their tenant (``api_keys: [{name, key, tenant}]``); a key without one, and every request when no
keys are configured, belongs to ``default``. A tenant named in a key but absent here gets the default policy.
The tenant's *name* is what travels with requests, blobs, audit records and metric labels, never its keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.ratelimit import TokenBucket
from prfaas.tenancy.redact import load_hook

DEFAULT_TENANT = "default"
TTL_LIMITS = (60.0, 300.0)
CODECS = ("none", "bf16", "fp8", "int8", "int4")  # prfaas.kv.codecs.CODECS (kept import-light here)
_NAME = re.compile(r"[a-z0-9_-]{1,64}")
_FIELDS = {"allowed_datacenters", "prompt_may_cross", "kv_codec", "kv_ttl_seconds", "rate_limit_qps", "redact"}


@dataclass(frozen=True)
class TenantPolicy:
    name: str = DEFAULT_TENANT
    allowed_datacenters: tuple[str, ...] = ()  # () = any datacenter
    prompt_may_cross: bool = True
    kv_codec: str = ""  # "" = the deployment's kv_codec
    kv_ttl_seconds: float = 0.0  # 0 = the deployment's kv_ttl_seconds
    rate_limit_qps: float = 0.0  # 0 = only the cluster's limit
    redact: str = ""  # "" = prompts pass unchanged

    def allows(self, datacenter: str) -> bool:
        """Whether this tenant's KV may be computed or held in ``datacenter``."""
        return not self.allowed_datacenters or datacenter in self.allowed_datacenters

    def offload_refusal(self, home: str, prefill_dc: str, relay_dc: str | None) -> tuple[str, str] | None:
        """``(reason_code, why)`` when this tenant's request may not be prefilled remotely: its prompt may not
        leave ``home`` (the router's datacenter), or the prefill's (or relay's) datacenter is not allowed to hold
        its KV. ``None`` when offload is allowed."""
        if not self.prompt_may_cross and prefill_dc != home:
            return "tenant_prompt_local", (f"tenant {self.name}'s prompts may not leave datacenter "
                                           f"{home or '(unlabelled)'}")
        for role, dc in (("prefill", prefill_dc), ("relay", relay_dc)):
            if dc is not None and not self.allows(dc):
                return "tenant_residency", (f"tenant {self.name}'s KV may only be held in "
                                            f"{', '.join(self.allowed_datacenters)}, not in the {role}'s "
                                            f"datacenter {dc or '(unlabelled)'}")
        return None


def parse_policy(name: str, spec: Any) -> TenantPolicy:
    """One tenant's policy; ``InvalidRequest`` naming the tenant and field for anything out of its limits."""
    where = f"tenants.{name}"
    if not _NAME.fullmatch(name):
        raise InvalidRequest(f"{where}: a tenant name is 1-64 characters of a-z, 0-9, _ and -")
    spec = dict(spec or {}) if isinstance(spec, Mapping | type(None)) else None
    if spec is None or set(spec) - _FIELDS:
        raise InvalidRequest(f"{where}: a mapping of {sorted(_FIELDS)}")
    dcs = spec.get("allowed_datacenters") or ()
    if isinstance(dcs, str) or not all(isinstance(d, str) and d for d in dcs):
        raise InvalidRequest(f"{where}.allowed_datacenters: a list of datacenter labels")
    codec, ttl = str(spec.get("kv_codec") or ""), float(spec.get("kv_ttl_seconds") or 0)
    qps = float(spec.get("rate_limit_qps") or 0)
    if codec and codec not in CODECS:
        raise InvalidRequest(f"{where}.kv_codec: one of {', '.join(CODECS)}")
    if ttl and not TTL_LIMITS[0] <= ttl <= TTL_LIMITS[1]:
        raise InvalidRequest(f"{where}.kv_ttl_seconds: within {TTL_LIMITS[0]:g}-{TTL_LIMITS[1]:g}")
    if qps < 0:
        raise InvalidRequest(f"{where}.rate_limit_qps: ≥ 0 (0: only the cluster's limit)")
    if not isinstance(spec.get("prompt_may_cross", True), bool):
        raise InvalidRequest(f"{where}.prompt_may_cross: true or false")
    redact = str(spec.get("redact") or "")
    if redact:
        load_hook(redact)  # refuse an unknown hook at start, not on the first request
    return TenantPolicy(name, tuple(dcs), spec.get("prompt_may_cross", True), codec, ttl, qps, redact)


@dataclass
class Tenants:
    """Every tenant's policy and its rate-limit bucket; unknown names get the default policy under their name."""

    policies: dict[str, TenantPolicy] = field(default_factory=dict)
    buckets: dict[str, TokenBucket] = field(default_factory=dict)

    @classmethod
    def from_config(cls, tenants: Mapping[str, Any], key_tenants: Iterable[str] = ()) -> Tenants:
        policies = {name: parse_policy(name, spec) for name, spec in tenants.items()}
        for name in key_tenants:
            if name not in policies:
                policies[name] = parse_policy(name, {})
        buckets = {n: TokenBucket(p.rate_limit_qps) for n, p in policies.items() if p.rate_limit_qps}
        return cls(policies, buckets)

    def policy(self, name: str) -> TenantPolicy:
        return self.policies.get(name) or TenantPolicy(name)

    def admit(self, name: str) -> float:
        """0 when the tenant's own bucket lets a request go, else the seconds until it would."""
        bucket = self.buckets.get(name)
        return bucket.take() if bucket else 0.0
