"""Where each role of ``prfaas up --lab`` runs: prefill (the pool) in dc-a; cluster ``i``'s router, relay and
decode in decode datacenter ``i`` (dc-b for cluster 0, dc-c for cluster 1, …; ``prfaas lab up --decode-dcs N``).

Every instance binds its datacenter's WAN address, so the URLs it registers with a router are reachable from
the other datacenter only through the lab's WAN: dc-a's address is reached by each cluster over its own link, and
the pool reaches cluster ``i``'s router, relay and decode over link ``i``. A router binds every address of its
datacenter: instances reach it over the WAN address, clients in the root namespace over the host veth
(``client_url``). Decode datacenters cannot reach each other, as separate clusters would not.
"""

from __future__ import annotations

from prfaas.errors import LabUnavailable
from prfaas.lab import state as lab_state
from prfaas.lab import topology
from prfaas.lab.spec import Topology, Wire

DATACENTER = {"router": "b", "relay": "b", "decode": "b", "prefill": "a"}


def wire(cluster: int = 0, topo: Topology | None = None) -> Wire:
    """Cluster ``cluster``'s link (``LabUnavailable`` when the lab has too few decode datacenters)."""
    topo = lab_state.running(topo or Topology())
    if not 0 <= cluster < topo.decode_dcs:
        raise LabUnavailable(f"cluster {cluster} needs {cluster + 1} decode datacenters; the lab has "
                             f"{topo.decode_dcs}: run `prfaas lab up --decode-dcs {cluster + 1}`")
    return topo.wires[cluster]


def namespace(role: str, topo: Topology | None = None, cluster: int = 0) -> str:
    topo = topo or Topology()
    return topo.ns_a if DATACENTER[role] == "a" else wire(cluster, topo).ns


def address(role: str, topo: Topology | None = None, cluster: int = 0) -> str:
    """The address ``role`` binds: dc-a's for prefill (shared by every cluster), else cluster's WAN end."""
    topo = topo or Topology()
    return topo.wan_a if DATACENTER[role] == "a" else wire(cluster, topo).wan_b


def place(role: str, cmd: list[str], topo: Topology | None = None, cluster: int = 0) -> list[str]:
    """``cmd`` (a ``prfaas serve ROLE`` command line) run inside its datacenter, bound to its address there."""
    ns = namespace(role, topo, cluster)
    if role != "router":
        return ["ip", "netns", "exec", ns, *cmd, "--host", address(role, topo, cluster)]
    # Every address of the datacenter, which only this host and dc-a can reach: not an exposure the API-key check
    # is about.
    return ["ip", "netns", "exec", ns, *cmd, "--host", "0.0.0.0", "--insecure"]


def router_url(port: int, topo: Topology | None = None, cluster: int = 0) -> str:
    """Cluster ``cluster``'s router as the instances see it (over its datacenter's WAN address)."""
    return f"http://{wire(cluster, topo).wan_b}:{port}"


def client_url(port: int, topo: Topology | None = None, cluster: int = 0) -> str:
    """Cluster ``cluster``'s router as a client in the root namespace sees it (over its host veth)."""
    return f"http://{wire(cluster, topo).public}:{port}"


def require_lab(topo: Topology | None = None, clusters: int = 1) -> None:
    """``LabUnavailable`` unless a lab is up (``prfaas lab up``) with a decode datacenter for each cluster."""
    from prfaas.lab.system import require_support

    require_support()
    if not topology.exists(topo or Topology()):
        raise LabUnavailable("--lab needs a lab that is up: run `prfaas lab up` first")
    wire(clusters - 1, topo)
