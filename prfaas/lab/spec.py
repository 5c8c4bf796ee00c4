"""What the lab is: the topology (namespaces, interfaces, addresses) and the link settings applied to each WAN.

One prefill datacenter (dc-a) and one or more decode datacenters (dc-b, dc-c, …), each on its own WAN link to
dc-a and with its own host veth to the root namespace (where clients run)::

    root ── host veth  (10.201.0.1 ↔ 10.201.0.2) ── dc-b ── wan0 (10.200.0.2 ↔ 10.200.0.1) ──┐
    root ── host veth1 (10.201.1.1 ↔ 10.201.1.2) ── dc-c ── wan1 (10.200.1.2 ↔ 10.200.1.1) ── dc-a

Link ``i`` is the veth ``wan<i>`` at both ends, subnet ``10.<subnet>.<i>.0/24``; its name is ``dc-a:dc-b``,
``dc-a:dc-c``, …. Every decode datacenter reaches dc-a's address (``wan_a``, 10.200.0.1) over its own link (a
host route), so one prefill pool has one address for every cluster; dc-a forwards nothing, so decode datacenters
cannot reach each other. With one decode datacenter this is the two-datacenter lab, addresses unchanged.

Link settings apply to a WAN veth in both directions, like ``netem`` on both ends: ``delay_ms`` and
``jitter_ms`` are one-way (RTT ≈ 2 × delay), ``loss`` is a per-direction probability (a round trip loses
1 − (1 − loss)², about 2 × loss), ``rate`` shapes each direction. Host veths are never shaped: they stand for the
users' side of each decode datacenter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.units import parse_rate

MAX_DECODE_DCS = 8


@dataclass(frozen=True)
class Wire:
    """One WAN link between dc-a and one decode datacenter, and that datacenter's host veth."""

    index: int
    ns_a: str
    ns: str  # the decode datacenter's namespace
    wan_if: str  # the same name at both ends
    host_if: str  # the root namespace's end of the host veth
    peer_if: str  # the decode datacenter's end of it
    wan_a: str  # dc-a's end of this link
    wan_b: str  # the decode datacenter's end
    host_ip: str
    public: str  # the decode datacenter as the root namespace sees it (where a client runs)

    @property
    def name(self) -> str:
        return f"{self.ns_a}:{self.ns}"


@dataclass(frozen=True)
class Topology:
    """Names and addresses. The default is the one ``prfaas lab`` and ``prfaas up --lab`` use; tests and other
    benchmarks pick another ``index`` so that they never collide with a lab someone else has up. Decode
    datacenters after ``ns_b`` take the next letters (``dc-c``, ``dc-d``); link ``i`` uses the third octet ``i``
    of the subnets, so a numbered topology with several decode datacenters never meets another index's."""

    ns_a: str = "dc-a"
    ns_b: str = "dc-b"
    wan_if: str = "wan0"
    host_if: str = "prfaas-lab"
    peer_if: str = "host0"
    subnet: int = 200  # link i's WAN is 10.<subnet>.<i>.0/24, its host link 10.<subnet + 1>.<i>.0/24
    decode_dcs: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.decode_dcs <= MAX_DECODE_DCS:
            raise InvalidRequest(f"lab: decode datacenters must be within 1–{MAX_DECODE_DCS}")
        if not ("a" <= self.ns_b[-1] <= chr(ord("z") - self.decode_dcs + 1)) or not self.wan_if[-1].isdigit():
            raise InvalidRequest("lab: ns_b must end in a letter and wan_if in a digit")

    @classmethod
    def numbered(cls, index: int, decode_dcs: int = 1) -> Topology:
        return cls(ns_a=f"pfl{index}-a", ns_b=f"pfl{index}-b", host_if=f"pfl{index}-host", subnet=210 + 2 * index,
                   decode_dcs=decode_dcs)

    def with_decode_dcs(self, decode_dcs: int) -> Topology:
        return dataclasses.replace(self, decode_dcs=decode_dcs)

    @property
    def wires(self) -> tuple[Wire, ...]:
        return tuple(self._wire(i) for i in range(self.decode_dcs))

    @property
    def decode_namespaces(self) -> list[str]:
        return [wire.ns for wire in self.wires]

    @property
    def namespaces(self) -> list[str]:
        return [self.ns_a, *self.decode_namespaces]

    def wire(self, key: str | int) -> Wire:
        """A link by index, by name (``dc-a:dc-c``) or by its decode datacenter (``dc-c``)."""
        for wire in self.wires:
            if key in (wire.index, wire.name, wire.ns, f"{wire.ns}:{self.ns_a}"):
                return wire
        names = ", ".join(wire.name for wire in self.wires)
        raise InvalidRequest(f"lab: no link {key!r}; this lab's links are {names}")

    def _wire(self, i: int) -> Wire:
        base = self.wan_if.rstrip("0123456789")
        return Wire(index=i, ns_a=self.ns_a, ns=self.ns_b[:-1] + chr(ord(self.ns_b[-1]) + i),
                    wan_if=f"{base}{int(self.wan_if[len(base):]) + i}", host_if=self.host_if + (str(i) if i else ""),
                    peer_if=self.peer_if, wan_a=f"10.{self.subnet}.{i}.1", wan_b=f"10.{self.subnet}.{i}.2",
                    host_ip=f"10.{self.subnet + 1}.{i}.1", public=f"10.{self.subnet + 1}.{i}.2")

    @property
    def wan_a(self) -> str:
        """dc-a's address: every decode datacenter reaches it over its own link."""
        return self._wire(0).wan_a

    @property
    def wan_b(self) -> str:
        return self._wire(0).wan_b

    @property
    def host_ip(self) -> str:
        return self._wire(0).host_ip

    @property
    def public_b(self) -> str:
        """dc-b's address as seen from the root namespace (where a benchmark client runs)."""
        return self._wire(0).public

    def address(self, ns: str) -> str:
        """The address a role binds in namespace ``ns``: dc-a's, or that decode datacenter's WAN end."""
        return self.wan_a if ns == self.ns_a else self.wire(ns).wan_b


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
