"""``prfaas up --lab --lab-index N`` uses the numbered lab ``Topology.numbered(N)`` (as the lab benchmarks build
beside the default lab), not dc-a / dc-b: clients reach each router over that lab's host veth, instances over its
WAN. Nothing is started."""

from __future__ import annotations

from prfaas.lab import Topology
from prfaas.services.up import Deployment, UpOptions


def test_a_numbered_lab_gives_the_urls_of_its_own_addresses() -> None:
    topo = Topology.numbered(10)
    deployment = Deployment(UpOptions(lab=True, lab_index=10, port=8430))
    assert deployment.urls == [f"http://{topo.wires[0].public}:8430"]
    assert deployment._router_seen_by_instances(0) == f"http://{topo.wires[0].wan_b}:8430"
    default = Deployment(UpOptions(lab=True, port=8430))
    assert default.urls == [f"http://{Topology().wires[0].public}:8430"] != deployment.urls
