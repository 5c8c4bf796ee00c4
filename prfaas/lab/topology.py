"""Build, shape and tear down the lab's namespaces. Idempotent where it can be: ``destroy`` removes whatever of the
lab exists (deleting a namespace deletes its veth ends, qdiscs and iptables rules with it).

dc-a holds one end of every link, so its iptables ruleset (replaced whole by ``iptables-restore``) is built from
the settings of all its links at once; a decode datacenter's holds only its own link's."""

from __future__ import annotations

from collections.abc import Mapping

from prfaas.lab.spec import LinkSettings, Topology, Wire
from prfaas.lab.system import namespaces, run

DELAY_QUEUE = 0  # the NFQUEUE number of packets arriving over link 0; link i uses DELAY_QUEUE + i
TBF_LATENCY = "50ms"
# Hosts on a long fat WAN raise TCP's buffer limits: with the default 6 MiB a 1 Gbit flow over 50 ms of RTT is
# capped near 0.4 Gbit/s by the receive window. Set per namespace (these sysctls are per network namespace).
TCP_BUFFERS = {"net/ipv4/tcp_rmem": "4096 131072 67108864", "net/ipv4/tcp_wmem": "4096 16384 67108864"}

Settings = Mapping[str, LinkSettings]  # by link name (``Wire.name``)


def exists(topo: Topology) -> bool:
    present = namespaces()
    return any(ns in present for ns in topo.namespaces)


def queue_of(wire: Wire) -> int:
    return DELAY_QUEUE + wire.index


def create(topo: Topology) -> None:
    """Create every namespace, a WAN veth from dc-a to each decode datacenter and a host veth to each; addresses
    up, and each decode datacenter's route to dc-a's address over its own link."""
    for ns in topo.namespaces:
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "set", "lo", "up"], ns=ns)
        for key, value in TCP_BUFFERS.items():
            run(["sh", "-c", f"echo '{value}' > /proc/sys/{key}"], ns=ns)
    for wire in topo.wires:
        _create_wire(topo, wire)


def _create_wire(topo: Topology, wire: Wire) -> None:
    run(["ip", "link", "add", f"{wire.host_if}-a", "type", "veth", "peer", "name", f"{wire.host_if}-b"])
    for side, ns, ip in (("a", topo.ns_a, wire.wan_a), ("b", wire.ns, wire.wan_b)):
        run(["ip", "link", "set", f"{wire.host_if}-{side}", "netns", ns, "name", wire.wan_if])
        run(["ip", "addr", "add", f"{ip}/24", "dev", wire.wan_if], ns=ns)
        run(["ip", "link", "set", wire.wan_if, "up"], ns=ns)
    if wire.wan_a != topo.wan_a:  # dc-a has one address for every cluster, reached over each one's own link
        run(["ip", "route", "add", f"{topo.wan_a}/32", "via", wire.wan_a, "dev", wire.wan_if], ns=wire.ns)
    run(["ip", "link", "add", wire.host_if, "type", "veth", "peer", "name", wire.peer_if, "netns", wire.ns])
    run(["ip", "addr", "add", f"{wire.host_ip}/24", "dev", wire.host_if])
    run(["ip", "link", "set", wire.host_if, "up"])
    run(["ip", "addr", "add", f"{wire.public}/24", "dev", wire.peer_if], ns=wire.ns)
    run(["ip", "link", "set", wire.peer_if, "up"], ns=wire.ns)


def destroy(topo: Topology) -> None:
    """Remove the namespaces and the host veths; silent about parts already gone."""
    present = namespaces()
    for ns in topo.namespaces:
        if ns in present:
            run(["ip", "netns", "del", ns], check=False)
    for wire in topo.wires:
        run(["ip", "link", "del", wire.host_if], check=False)


def apply(topo: Topology, settings: Settings) -> None:
    """Make each WAN match its settings: MTU, rate (tbf), and the iptables rules for loss, cut and the delay queue.

    A delay queue's rule is only installed when its link is ``delayed``; the caller starts that link's delayer
    first (a queue without a reader drops its packets)."""
    for ns in topo.namespaces:
        ends = _ends(topo, ns, settings)
        for wire, link in ends:
            run(["ip", "link", "set", wire.wan_if, "mtu", str(link.mtu)], ns=ns)
            _shape(wire, ns, link.rate_bps)
        run(["iptables-restore"], ns=ns, stdin=ruleset(ends))


def _ends(topo: Topology, ns: str, settings: Settings) -> list[tuple[Wire, LinkSettings]]:
    """The links with an end in ``ns``, with their settings."""
    return [(wire, settings[wire.name]) for wire in topo.wires if ns in (topo.ns_a, wire.ns)]


def _shape(wire: Wire, ns: str, rate_bps: float | None) -> None:
    if rate_bps is None:
        run(["tc", "qdisc", "del", "dev", wire.wan_if, "root"], ns=ns, check=False)
        return
    burst = max(32 * 1024, int(rate_bps / 8 * 0.002))  # 2 ms of line rate, at least 32 KiB
    run(["tc", "qdisc", "replace", "dev", wire.wan_if, "root", "tbf", "rate", f"{int(rate_bps)}bit",
         "burst", str(burst), "latency", TBF_LATENCY], ns=ns)


def rules(topo: Topology, link: LinkSettings) -> str:
    """The ruleset of a namespace at either end of link 0 (the two-datacenter lab's only link)."""
    return ruleset([(topo.wires[0], link)])


def ruleset(ends: list[tuple[Wire, LinkSettings]]) -> str:
    """The whole iptables ruleset of one namespace (both tables are replaced at once by iptables-restore).

    Loss and cut act on arrival (INPUT), never on a local send: a drop on OUTPUT would fail the sender's
    ``send`` with EPERM instead of losing the packet silently as a WAN does."""
    mangle = ["*mangle", ":PREROUTING ACCEPT [0:0]"]
    filt = ["*filter", ":INPUT ACCEPT [0:0]"]
    for wire, link in ends:
        wan = wire.wan_if
        if link.delayed:
            mangle.append(f"-A PREROUTING -i {wan} -j NFQUEUE --queue-num {queue_of(wire)}")
        if link.cut:
            filt.append(f"-A INPUT -i {wan} -j DROP")
        if link.loss > 0:
            filt.append(f"-A INPUT -i {wan} -m statistic --mode random --probability {link.loss:.6f} -j DROP")
    return "\n".join([*mangle, "COMMIT", *filt, "COMMIT", ""])


def describe(topo: Topology, wire: Wire) -> dict[str, str]:
    """What the kernel reports for one link at each end: qdisc, iptables rules, link (for ``lab status``)."""
    out: dict[str, str] = {}
    for ns in (topo.ns_a, wire.ns):
        out[f"{ns} qdisc"] = run(["tc", "qdisc", "show", "dev", wire.wan_if], ns=ns, check=False).strip()
        out[f"{ns} link"] = run(["ip", "-br", "link", "show", wire.wan_if], ns=ns, check=False).strip()
        saved = run(["iptables-save"], ns=ns, check=False)
        out[f"{ns} rules"] = "\n".join(line for line in saved.splitlines()
                                       if line.startswith("-A") and f"-i {wire.wan_if} " in line)
    return out
