"""Build, shape and tear down the two namespaces. Idempotent where it can be: ``destroy`` removes whatever of the
lab exists (deleting a namespace deletes its veth ends, qdiscs and iptables rules with it)."""

from __future__ import annotations

from prfaas.lab.spec import LinkSettings, Topology
from prfaas.lab.system import namespaces, run

DELAY_QUEUE = 0  # the NFQUEUE number, in each namespace, of packets arriving over the WAN
TBF_LATENCY = "50ms"
# Hosts on a long fat WAN raise TCP's buffer limits: with the default 6 MiB a 1 Gbit flow over 50 ms of RTT is
# capped near 0.4 Gbit/s by the receive window. Set per namespace (these sysctls are per network namespace).
TCP_BUFFERS = {"net/ipv4/tcp_rmem": "4096 131072 67108864", "net/ipv4/tcp_wmem": "4096 16384 67108864"}


def exists(topo: Topology) -> bool:
    present = namespaces()
    return topo.ns_a in present or topo.ns_b in present


def create(topo: Topology) -> None:
    """Create both namespaces, the WAN veth between them and the host veth to dc-b; addresses up."""
    for ns in (topo.ns_a, topo.ns_b):
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "set", "lo", "up"], ns=ns)
        for key, value in TCP_BUFFERS.items():
            run(["sh", "-c", f"echo '{value}' > /proc/sys/{key}"], ns=ns)
    run(["ip", "link", "add", f"{topo.host_if}-a", "type", "veth", "peer", "name", f"{topo.host_if}-b"])
    for side, ns, ip in (("a", topo.ns_a, topo.wan_a), ("b", topo.ns_b, topo.wan_b)):
        run(["ip", "link", "set", f"{topo.host_if}-{side}", "netns", ns, "name", topo.wan_if])
        run(["ip", "addr", "add", f"{ip}/24", "dev", topo.wan_if], ns=ns)
        run(["ip", "link", "set", topo.wan_if, "up"], ns=ns)
    run(["ip", "link", "add", topo.host_if, "type", "veth", "peer", "name", topo.peer_if, "netns", topo.ns_b])
    run(["ip", "addr", "add", f"{topo.host_ip}/24", "dev", topo.host_if])
    run(["ip", "link", "set", topo.host_if, "up"])
    run(["ip", "addr", "add", f"{topo.public_b}/24", "dev", topo.peer_if], ns=topo.ns_b)
    run(["ip", "link", "set", topo.peer_if, "up"], ns=topo.ns_b)


def destroy(topo: Topology) -> None:
    """Remove the namespaces and the host veth; silent about parts already gone."""
    present = namespaces()
    for ns in (topo.ns_a, topo.ns_b):
        if ns in present:
            run(["ip", "netns", "del", ns], check=False)
    run(["ip", "link", "del", topo.host_if], check=False)


def apply(topo: Topology, link: LinkSettings) -> None:
    """Make the WAN match ``link``: MTU, rate (tbf), and the iptables rules for loss, cut and the delay queue.

    The delay queue's rule is only installed when ``link.delayed``; the caller starts the delayer first (a queue
    without a reader drops its packets)."""
    for ns in (topo.ns_a, topo.ns_b):
        run(["ip", "link", "set", topo.wan_if, "mtu", str(link.mtu)], ns=ns)
        _shape(topo, ns, link.rate_bps)
        run(["iptables-restore"], ns=ns, stdin=rules(topo, link))


def _shape(topo: Topology, ns: str, rate_bps: float | None) -> None:
    if rate_bps is None:
        run(["tc", "qdisc", "del", "dev", topo.wan_if, "root"], ns=ns, check=False)
        return
    burst = max(32 * 1024, int(rate_bps / 8 * 0.002))  # 2 ms of line rate, at least 32 KiB
    run(["tc", "qdisc", "replace", "dev", topo.wan_if, "root", "tbf", "rate", f"{int(rate_bps)}bit",
         "burst", str(burst), "latency", TBF_LATENCY], ns=ns)


def rules(topo: Topology, link: LinkSettings) -> str:
    """The whole iptables ruleset of one namespace (both tables are replaced at once by iptables-restore).

    Loss and cut act on arrival (INPUT), never on a local send: a drop on OUTPUT would fail the sender's
    ``send`` with EPERM instead of losing the packet silently as a WAN does."""
    wan = topo.wan_if
    mangle = ["*mangle", ":PREROUTING ACCEPT [0:0]"]
    if link.delayed:
        mangle.append(f"-A PREROUTING -i {wan} -j NFQUEUE --queue-num {DELAY_QUEUE}")
    filt = ["*filter", ":INPUT ACCEPT [0:0]"]
    if link.cut:
        filt.append(f"-A INPUT -i {wan} -j DROP")
    if link.loss > 0:
        filt.append(f"-A INPUT -i {wan} -m statistic --mode random --probability {link.loss:.6f} -j DROP")
    return "\n".join([*mangle, "COMMIT", *filt, "COMMIT", ""])


def describe(topo: Topology) -> dict[str, str]:
    """What the kernel reports for the WAN in each namespace: qdisc, iptables rules, link (for ``lab status``)."""
    out: dict[str, str] = {}
    for ns in (topo.ns_a, topo.ns_b):
        out[f"{ns} qdisc"] = run(["tc", "qdisc", "show", "dev", topo.wan_if], ns=ns, check=False).strip()
        out[f"{ns} link"] = run(["ip", "-br", "link", "show", topo.wan_if], ns=ns, check=False).strip()
        saved = run(["iptables-save"], ns=ns, check=False)
        out[f"{ns} rules"] = "\n".join(line for line in saved.splitlines() if line.startswith("-A"))
    return out
