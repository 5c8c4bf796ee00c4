"""Where each role of ``prfaas up --lab`` runs: prefill in dc-a; router, relay and decode in dc-b.

Every instance binds its datacenter's WAN address, so the URLs it registers with the router are reachable from
the other datacenter only through the lab's WAN. The router binds every address of dc-b: instances reach it over
the WAN address, clients in the root namespace over the host veth (``client_url``).
"""

from __future__ import annotations

from prfaas.errors import LabUnavailable
from prfaas.lab import topology
from prfaas.lab.spec import Topology

DATACENTER = {"router": "b", "relay": "b", "decode": "b", "prefill": "a"}


def namespace(role: str, topo: Topology | None = None) -> str:
    topo = topo or Topology()
    return topo.ns_a if DATACENTER[role] == "a" else topo.ns_b


def place(role: str, cmd: list[str], topo: Topology | None = None) -> list[str]:
    """``cmd`` (a ``prfaas serve ROLE`` command line) run inside its datacenter, bound to its address there."""
    topo = topo or Topology()
    ns = namespace(role, topo)
    if role != "router":
        return ["ip", "netns", "exec", ns, *cmd, "--host", topo.address(ns)]
    # Every address of dc-b, which only this host and dc-a can reach: not an exposure the API-key check is about.
    return ["ip", "netns", "exec", ns, *cmd, "--host", "0.0.0.0", "--insecure"]


def router_url(port: int, topo: Topology | None = None) -> str:
    """The router as the instances see it (over dc-b's WAN address)."""
    return f"http://{(topo or Topology()).wan_b}:{port}"


def client_url(port: int, topo: Topology | None = None) -> str:
    """The router as a client in the root namespace sees it (over the host veth)."""
    return f"http://{(topo or Topology()).public_b}:{port}"


def require_lab(topo: Topology | None = None) -> None:
    """``LabUnavailable`` unless a lab is up (``prfaas lab up``)."""
    from prfaas.lab.system import require_support

    require_support()
    if not topology.exists(topo or Topology()):
        raise LabUnavailable("--lab needs a lab that is up: run `prfaas lab up` first")
