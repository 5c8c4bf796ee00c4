"""What the lab is: the topology (namespaces, interfaces, addresses) and the link settings applied to its WAN.

    root namespace ── host veth (10.201.0.1 ↔ 10.201.0.2) ── dc-b ── wan veth (10.200.0.2 ↔ 10.200.0.1) ── dc-a

Link settings apply to the WAN veth in both directions, like ``netem`` on both ends: ``delay_ms`` and
``jitter_ms`` are one-way (RTT ≈ 2 × delay), ``loss`` is a per-direction probability (a round trip loses
1 − (1 − loss)², about 2 × loss), ``rate`` shapes each direction. The host veth is never shaped: it stands for the
users' side of datacenter B.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.units import parse_rate


@dataclass(frozen=True)
class Topology:
    """Names and addresses. The default is the one ``prfaas lab`` and ``prfaas up --lab`` use; tests and other
    benchmarks pick another ``index`` so that they never collide with a lab someone else has up."""

    ns_a: str = "dc-a"
    ns_b: str = "dc-b"
    wan_if: str = "wan0"
    host_if: str = "prfaas-lab"
    peer_if: str = "host0"
    subnet: int = 200  # WAN is 10.<subnet>.0.0/24, host link 10.<subnet + 1>.0.0/24

    @classmethod
    def numbered(cls, index: int) -> Topology:
        return cls(ns_a=f"pfl{index}-a", ns_b=f"pfl{index}-b", host_if=f"pfl{index}-host", subnet=210 + 2 * index)

    @property
    def wan_a(self) -> str:
        return f"10.{self.subnet}.0.1"

    @property
    def wan_b(self) -> str:
        return f"10.{self.subnet}.0.2"

    @property
    def host_ip(self) -> str:
        return f"10.{self.subnet + 1}.0.1"

    @property
    def public_b(self) -> str:
        """dc-b's address as seen from the root namespace (where a benchmark client runs)."""
        return f"10.{self.subnet + 1}.0.2"

    def address(self, ns: str) -> str:
        return self.wan_a if ns == self.ns_a else self.wan_b


@dataclass(frozen=True)
class LinkSettings:
    """The WAN's behaviour. ``rate`` None = unshaped (veth line rate); ``cut`` drops every packet both ways."""

    rate: str | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    mtu: int = 1500
    cut: bool = False

    def __post_init__(self) -> None:
        if self.rate is not None and parse_rate(self.rate) < 8000:
            raise InvalidRequest(f"rate {self.rate!r} is below 8 kbit/s")
        checks = [(0 <= self.delay_ms <= 10_000, "delay must be within 0–10 s"),
                  (0 <= self.jitter_ms <= self.delay_ms or self.jitter_ms == 0, "jitter must be within 0–delay"),
                  (0 <= self.loss < 1, "loss must be within [0, 1)"),
                  (576 <= self.mtu <= 65_535, "mtu must be within 576–65535")]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(f"lab: {message}")

    @property
    def rate_bps(self) -> float | None:
        return parse_rate(self.rate) if self.rate else None

    @property
    def delayed(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0

    def replace(self, **changes: Any) -> LinkSettings:
        """A copy with the changes that are not None."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinkSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
