"""The three-datacenter lab (dc-a, and two decode datacenters each on its own link) with real namespaces, veths,
qdiscs, iptables rules and delayers (root only): each link's settings reach that link only, measured by TCP
connects inside the namespaces, and nothing is left behind (namespaces, interfaces, delayers, state).

The API tests use their own numbered topology; the CLI test needs the default one and skips when a lab is up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prfaas.errors import InvalidRequest
from prfaas.lab import Lab, LinkSettings, Topology, missing_support
from prfaas.lab import state as lab_state
from prfaas.lab.lab import _is_delayer
from prfaas.lab.system import namespaces
from prfaas.lab.topology import ruleset

REASON = missing_support()
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"lab unavailable here: {REASON}")
PORT = 7779
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "lab-three.yaml"
# Accepts and closes connections for a bounded time: each connect a client times is one round trip.
ACCEPTOR = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); "
            f"s.bind((sys.argv[1],{PORT})); s.listen(64); s.settimeout(60)\n"
            "while True:\n c,_=s.accept(); c.close()")
# The smallest of five connect times in ms, or -1 when the link does not answer.
CONNECT = ("import socket,sys,time\nbest=-1.0\nfor _ in range(5):\n t=time.perf_counter()\n try:\n"
           f"  socket.create_connection((sys.argv[1],{PORT}),timeout=1.5).close()\n except OSError:\n  continue\n"
           " ms=(time.perf_counter()-t)*1e3; best=ms if best<0 else min(best,ms)\nprint(best)")


def _leftovers(topo: Topology) -> list[str]:
    """Whatever of the lab still exists: namespaces, host veths, state, delayers."""
    left = [ns for ns in topo.namespaces if ns in namespaces()]
    left += [wire.host_if for wire in topo.wires if os.path.exists(f"/sys/class/net/{wire.host_if}")]
    left += [path for path in (lab_state.path(topo),) if os.path.exists(path)]
    return left


@pytest.fixture
def three() -> Iterator[Topology]:
    topo = Topology.numbered(9, decode_dcs=2)
    Lab(topo=topo).down()  # a previous run that died
    yield topo
    Lab(topo=topo).down()
    assert _leftovers(topo) == []


def _rtt_ms(lab: Lab, ns: str, address: str) -> float:
    done = subprocess.run(lab.exec_argv(ns, [sys.executable, "-c", CONNECT, address]), capture_output=True,
                          text=True, timeout=60)
    return float(done.stdout.strip() or -1)


@needs_lab
def test_each_link_gets_its_own_settings(three: Topology) -> None:
    b, c = three.wires
    lab = Lab(LinkSettings(rate="1gbit"), three, {c.name: LinkSettings(rate="200mbit", delay_ms=12.5)})
    with lab:
        acceptor = subprocess.Popen(lab.exec_argv(three.ns_a, [sys.executable, "-c", ACCEPTOR, three.wan_a]))
        try:
            assert _wait_rtt(lab, b.ns, three.wan_a) >= 0  # the acceptor may still be starting
            # A delay line never delivers early: dc-c's round trip is at least 2 × 12.5 ms; dc-b's has no delay.
            assert _rtt_ms(lab, c.ns, three.wan_a) >= 25.0
            assert 0 <= _rtt_ms(lab, b.ns, three.wan_a) < 12.5
            status = lab.status()["links"]
            assert "rate 200Mbit" in status[c.name]["kernel"][f"{c.ns} qdisc"]
            assert "rate 1Gbit" in status[b.name]["kernel"][f"{b.ns} qdisc"]
            assert status[c.name]["delayer"]["running"] and status[b.name]["delayer"]["pid"] is None

            lab.set(b.name, cut=True)  # cut dc-b's link: dc-c still reaches dc-a, through its delay
            assert _rtt_ms(lab, b.ns, three.wan_a) < 0
            assert _rtt_ms(lab, c.ns, three.wan_a) >= 25.0
            assert lab.current(c.name) == LinkSettings(rate="200mbit", delay_ms=12.5)

            lab.set(b.name, cut=False, delay_ms=5)
            lab.set(c.name, delay_ms=0)
            assert _rtt_ms(lab, b.ns, three.wan_a) >= 10.0
            assert 0 <= _rtt_ms(lab, c.ns, three.wan_a) < 5.0
            pids = {name: link["delayer"]["pid"] for name, link in lab.status()["links"].items()}
            assert _is_delayer(pids[b.name]) and pids[c.name] is None
        finally:
            acceptor.kill()
            acceptor.wait()
    assert not _is_delayer(pids[b.name])


def _wait_rtt(lab: Lab, ns: str, address: str) -> float:
    for _ in range(10):
        rtt = _rtt_ms(lab, ns, address)
        if rtt >= 0:
            return rtt
        time.sleep(0.3)
    return -1.0


@needs_lab
def test_decode_datacenters_reach_only_dc_a(three: Topology) -> None:
    b, c = three.wires
    with Lab(topo=three) as lab:
        acceptor = subprocess.Popen(lab.exec_argv(b.ns, [sys.executable, "-c", ACCEPTOR, b.wan_b]))
        try:
            assert _wait_rtt(lab, three.ns_a, b.wan_b) >= 0
            assert _rtt_ms(lab, c.ns, b.wan_b) < 0  # dc-a forwards nothing: clusters do not see each other
        finally:
            acceptor.kill()
            acceptor.wait()


@needs_lab
def test_a_lab_without_its_state_is_still_removed(three: Topology) -> None:
    Lab(topo=three).up()
    os.unlink(lab_state.path(three))  # e.g. /run cleared by hand
    Lab(topo=Topology.numbered(9)).down()  # knows nothing of dc-c, removes it all the same
    assert _leftovers(three) == []


def test_numbered_topologies_never_share_a_subnet_or_a_name() -> None:
    seen: dict[str, str] = {}
    for index in range(12):
        topo = Topology.numbered(index, decode_dcs=3)
        for wire in topo.wires:
            for key in (wire.ns, wire.host_if, wire.wan_a.rsplit(".", 1)[0], wire.host_ip.rsplit(".", 1)[0]):
                assert seen.setdefault(key, wire.name) == wire.name, key
            assert len(wire.host_if) < 13  # an interface name has at most 15 characters: room for "-a"
    default = Topology(decode_dcs=2)
    assert [w.name for w in default.wires] == ["dc-a:dc-b", "dc-a:dc-c"]
    assert (default.wan_a, default.wan_b, default.public_b) == ("10.200.0.1", "10.200.0.2", "10.201.0.2")
    assert default.wire("dc-c") is not None and default.wire("dc-a:dc-c").wan_if == "wan1"
    with pytest.raises(InvalidRequest, match="no link"):
        default.wire("dc-a:dc-d")


def test_dc_a_rules_cover_every_link_with_its_own_queue() -> None:
    b, c = Topology(decode_dcs=2).wires
    text = ruleset([(b, LinkSettings(loss=0.01)), (c, LinkSettings(delay_ms=12.5, cut=True))])
    assert "-A PREROUTING -i wan1 -j NFQUEUE --queue-num 1" in text
    assert "-i wan0 -j NFQUEUE" not in text
    assert "-A INPUT -i wan1 -j DROP" in text and "-A INPUT -i wan0 -j DROP" not in text
    assert "-A INPUT -i wan0 -m statistic" in text


def _prfaas(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prfaas", "lab", *args], capture_output=True, text=True,
                          timeout=120)


@needs_lab
def test_cli_sets_one_link_of_a_three_datacenter_lab() -> None:
    topo = Topology(decode_dcs=2)
    if any(ns in namespaces() for ns in topo.namespaces):
        pytest.skip("a lab is up on this host; not touching it")
    try:
        up = _prfaas("up", "--decode-dcs", "2", "--rate", "1gbit")
        assert up.returncode == 0, up.stderr
        assert "dc-c is 10.201.1.2" in up.stdout
        again = _prfaas("up", "--topology", str(EXAMPLE))
        assert again.returncode == 2 and "already up" in again.stderr
        done = _prfaas("set", "--link", "dc-a:dc-c", "--delay", "25ms")
        assert done.returncode == 0, done.stderr
        assert _prfaas("set", "--link", "dc-b", "--loss", "1%").returncode == 0
        links = json.loads(_prfaas("status", "--json").stdout.strip().splitlines()[-1])["links"]
        assert links["dc-a:dc-c"]["settings"] == LinkSettings(rate="1gbit", delay_ms=25).to_json()
        assert links["dc-a:dc-b"]["settings"] == LinkSettings(rate="1gbit", loss=0.01).to_json()
        assert links["dc-a:dc-c"]["delayer"]["running"] and not links["dc-a:dc-b"]["delayer"]["running"]
        bad = _prfaas("set", "--link", "dc-a:dc-d", "--delay", "1ms")
        assert bad.returncode == 2 and "no link 'dc-a:dc-d'" in bad.stderr
        assert _prfaas("set", "--rate", "500mbit").returncode == 0  # without --link: every link
        links = json.loads(_prfaas("status", "--json").stdout.strip().splitlines()[-1])["links"]
        assert {link["settings"]["rate"] for link in links.values()} == {"500mbit"}
        assert links["dc-a:dc-c"]["settings"]["delay_ms"] == 25
        delayer = links["dc-a:dc-c"]["delayer"]["pid"]
    finally:
        down = _prfaas("down")
    assert down.returncode == 0, down.stderr
    assert _leftovers(topo) == [] and not _is_delayer(delayer)


@needs_lab
def test_cli_builds_the_lab_of_a_topology_file() -> None:
    topo = Topology(decode_dcs=2)
    if any(ns in namespaces() for ns in topo.namespaces):
        pytest.skip("a lab is up on this host; not touching it")
    try:
        up = _prfaas("up", "--topology", str(EXAMPLE), "--mtu", "1400")  # the flags set what the file does not
        assert up.returncode == 0, up.stderr
        links = json.loads(_prfaas("status", "--json").stdout.strip().splitlines()[-1])["links"]
        assert links["dc-a:dc-b"]["settings"] == LinkSettings(rate="10gbit", delay_ms=2.5, mtu=1400).to_json()
        assert links["dc-a:dc-c"]["settings"] == LinkSettings(rate="1gbit", delay_ms=12.5, mtu=1400).to_json()
        assert all(link["delayer"]["running"] for link in links.values())
        pids = [link["delayer"]["pid"] for link in links.values()]
    finally:
        down = _prfaas("down")
    assert down.returncode == 0, down.stderr
    assert _leftovers(topo) == [] and not any(_is_delayer(pid) for pid in pids)


def test_a_bad_topology_file_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    bad = tmp_path / "lab.yaml"
    bad.write_text("decode_dcs: 2\nlinks:\n  dc-a:dc-c: {rate: 1gbit, latency: 5ms}\n")
    done = _prfaas("up", "--topology", str(bad))
    assert done.returncode == 2 and "dc-a:dc-c.latency" in done.stderr
    bad.write_text("links:\n  dc-a:dc-c: {rate: 1gbit}\n")  # one decode datacenter has no dc-c
    done = _prfaas("up", "--topology", str(bad))
    assert done.returncode == 2 and "no link 'dc-a:dc-c'" in done.stderr
