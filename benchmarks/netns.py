"""Two network namespaces joined by a veth pair, optionally rate-limited with ``tbf`` on both ends, for benchmarks.

A stop-gap until ``prfaas.lab`` offers the same: ``with veth_pair("10gbit") as pair:`` runs commands in either
namespace with ``pair.cmd("a", [...])``; everything is deleted on exit, even after a failure. Addresses are
private to the two namespaces this process created (10.77.0.1 in ``a``, 10.77.0.2 in ``b``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

ADDR = {"a": "10.77.0.1", "b": "10.77.0.2"}


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    if os.geteuid() != 0:
        return "needs root for ip netns"
    probe = f"prfaas-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"ip netns add failed: {made.stderr.decode().strip()}"


@dataclass(frozen=True)
class Pair:
    names: dict[str, str]
    rate: str | None

    def cmd(self, side: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[side], *argv]


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True)


@contextlib.contextmanager
def veth_pair(rate: str | None, burst: str | None = None) -> Iterator[Pair]:
    """Namespaces ``a`` and ``b`` joined by veth; ``rate`` (e.g. ``1gbit``) shapes both directions with tbf."""
    tag = f"pf{os.getpid() % 100000}"
    names = {"a": f"{tag}a", "b": f"{tag}b"}
    try:
        for ns in names.values():
            _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for side, ns in names.items():
            dev = f"{tag}v{side}"
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{ADDR[side]}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if rate:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", burst or "256kb", "latency", "50ms")
        yield Pair(names, rate)
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
