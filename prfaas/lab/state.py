"""What a lab that is up remembers between commands: its settings and its delayer's pid, in /run (cleared at
boot, like the namespaces themselves). One file per topology."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from prfaas.lab.spec import LinkSettings, Topology

STATE_DIR = "/run/prfaas-lab"


@dataclass
class LabState:
    link: LinkSettings = field(default_factory=LinkSettings)
    delayer_pid: int | None = None
    created: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"link": self.link.to_json(), "delayer_pid": self.delayer_pid, "created": self.created}


def path(topo: Topology, suffix: str = "json") -> str:
    return os.path.join(STATE_DIR, f"{topo.ns_a}.{suffix}")


def load(topo: Topology) -> LabState | None:
    try:
        with open(path(topo)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return LabState(link=LinkSettings.from_json(data.get("link", {})), delayer_pid=data.get("delayer_pid"),
                    created=float(data.get("created", 0.0)))


def save(topo: Topology, state: LabState) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = path(topo) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state.to_json(), f)
    os.replace(tmp, path(topo))


def remove(topo: Topology) -> None:
    for suffix in ("json", "ready", "log"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path(topo, suffix))
