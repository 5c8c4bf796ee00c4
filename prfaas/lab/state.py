"""What a lab that is up remembers between commands: how many decode datacenters it has, and each link's settings
and delayer pid, in /run (cleared at boot, like the namespaces themselves). One file per topology, named after its
prefill datacenter."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from prfaas.lab.spec import LinkSettings, Topology

STATE_DIR = "/run/prfaas-lab"


@dataclass
class LinkState:
    settings: LinkSettings = field(default_factory=LinkSettings)
    delayer_pid: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings.to_json(), "delayer_pid": self.delayer_pid}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinkState:
        return cls(LinkSettings.from_json(data.get("settings", {})), data.get("delayer_pid"))


@dataclass
class LabState:
    links: dict[str, LinkState] = field(default_factory=dict)  # by link name, in link order
    decode_dcs: int = 1
    created: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"links": {name: link.to_json() for name, link in self.links.items()}, "decode_dcs": self.decode_dcs,
                "created": self.created}


def path(topo: Topology, suffix: str = "json") -> str:
    return os.path.join(STATE_DIR, f"{topo.ns_a}.{suffix}")


def load(topo: Topology) -> LabState | None:
    try:
        with open(path(topo)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    links = {name: LinkState.from_json(link) for name, link in data.get("links", {}).items()}
    return LabState(links=links, decode_dcs=int(data.get("decode_dcs", 1)), created=float(data.get("created", 0.0)))


def running(topo: Topology) -> Topology:
    """``topo`` with the number of decode datacenters of the lab that is up (``topo`` itself when none is)."""
    saved = load(topo)
    return topo.with_decode_dcs(saved.decode_dcs) if saved else topo


def save(topo: Topology, state: LabState) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = path(topo) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state.to_json(), f)
    os.replace(tmp, path(topo))


def remove(topo: Topology) -> None:
    for suffix in ("json", "log", *(f"{wire.index}.ready" for wire in topo.wires)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path(topo, suffix))
