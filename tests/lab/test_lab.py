"""The lab with real namespaces, veths, qdiscs and iptables rules (root only), and its refusals without root.

Each test uses its own numbered topology, so it never touches a lab someone has up, and ends by checking that
nothing is left behind: namespaces, the host veth, the delayer, the state file."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from prfaas.errors import LabUnavailable
from prfaas.lab import Lab, LinkSettings, Topology, missing_support
from prfaas.lab import state as lab_state
from prfaas.lab.lab import _is_delayer
from prfaas.lab.system import namespaces
from prfaas.lab.topology import rules

REASON = missing_support()
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"lab unavailable here: {REASON}")
ECHO_SERVER = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); "
               "s.bind((sys.argv[1],7777)); s.listen(); s.settimeout(20)\n"
               "for _ in range(8):\n c,_=s.accept(); c.sendall(c.recv(16)); c.close()")
ECHO_CLIENT = ("import socket,sys; c=socket.create_connection((sys.argv[1],7777),timeout=1.5); c.sendall(b'ping'); "
               "print(c.recv(16).decode())")


@pytest.fixture
def topo() -> Iterator[Topology]:
    topo = Topology.numbered(7)
    Lab(topo=topo).down()  # a previous run that died
    yield topo
    Lab(topo=topo).down()
    assert topo.ns_a not in namespaces() and topo.ns_b not in namespaces()
    assert not os.path.exists(f"/sys/class/net/{topo.host_if}")
    assert lab_state.load(topo) is None


def _echo(lab: Lab, topo: Topology) -> bool:
    """One TCP round trip from dc-a to dc-b across the WAN."""
    done = subprocess.run(lab.exec_argv(topo.ns_a, [sys.executable, "-c", ECHO_CLIENT, topo.wan_b]),
                          capture_output=True, text=True, timeout=30)
    return done.stdout.strip() == "ping"


@needs_lab
def test_lab_shapes_delays_loses_cuts_and_restores(topo: Topology) -> None:
    with Lab(LinkSettings(rate="200mbit", mtu=1400), topo) as lab:
        server = subprocess.Popen(lab.exec_argv(topo.ns_b, [sys.executable, "-c", ECHO_SERVER, topo.wan_b]))
        try:
            status = lab.status()
            assert status["up"] and "tbf" in status["kernel"][f"{topo.ns_a} qdisc"]
            assert "mtu 1400" in subprocess.run(["ip", "-n", topo.ns_a, "link", "show", "wan0"],
                                                capture_output=True, text=True).stdout
            assert _wait_echo(lab, topo)
            lab.set(delay_ms=5, jitter_ms=1)
            assert lab.status()["delayer"]["running"]
            assert _echo(lab, topo)  # traffic passes through the delay line
            lab.set(loss=0.02)
            assert "statistic" in lab.status()["kernel"][f"{topo.ns_b} rules"]
            lab.set(cut=True)
            assert not _echo(lab, topo)
            lab.set(cut=False, delay_ms=0, jitter_ms=0, loss=0)
            assert not lab.status()["delayer"]["running"]
            assert _echo(lab, topo)
        finally:
            server.kill()
            server.wait()
        assert lab_state.load(topo) is not None  # the state lives as long as the lab


def _wait_echo(lab: Lab, topo: Topology) -> bool:
    return any(_echo(lab, topo) for _ in range(5))  # the server may still be starting


@needs_lab
def test_up_refuses_a_second_lab_and_down_is_idempotent(topo: Topology) -> None:
    with Lab(topo=topo) as lab:
        with pytest.raises(LabUnavailable, match="already up"):
            Lab(topo=topo).up()
        lab.set(delay_ms=2)
        pid = lab.status()["delayer"]["pid"]
    assert not _is_delayer(pid)
    Lab(topo=topo).down()
    with pytest.raises(LabUnavailable, match="no lab is up"):
        Lab(topo=topo).set(loss=0.1)


def test_rules_put_loss_and_cut_on_arrival_and_delay_in_a_queue() -> None:
    text = rules(Topology(), LinkSettings(delay_ms=10, loss=0.01, cut=True))
    assert "-A PREROUTING -i wan0 -j NFQUEUE --queue-num 0" in text
    assert "-A INPUT -i wan0 -j DROP" in text
    assert "--mode random --probability 0.010000 -j DROP" in text
    assert "NFQUEUE" not in rules(Topology(), LinkSettings())


def test_settings_are_validated() -> None:
    from prfaas.errors import InvalidRequest

    for bad in ({"loss": 1.5}, {"delay_ms": -1}, {"jitter_ms": 5, "delay_ms": 1}, {"mtu": 100}, {"rate": "1kbit"}):
        with pytest.raises(InvalidRequest):
            LinkSettings(**bad)  # type: ignore[arg-type]


def test_without_root_the_lab_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in (missing_support() or "")
    with pytest.raises(LabUnavailable, match="root"):
        Lab(topo=Topology.numbered(8)).up()


def test_cli_without_a_lab_exits_cleanly() -> None:
    done = subprocess.run([sys.executable, "-m", "prfaas", "lab", "set", "--loss", "1%"], capture_output=True,
                          text=True, timeout=60)
    if "dc-a" in namespaces():
        pytest.skip("a lab is up on this host; not touching it")
    assert done.returncode == 2 and "LAB_UNAVAILABLE" in done.stderr
