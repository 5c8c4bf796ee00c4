"""``Lab``: the Python API of the lab (the CLI and ``prfaas up --lab`` use it; so may benchmarks).

    with Lab(LinkSettings(rate="1gbit", delay_ms=10)) as lab:   # up on enter, down on exit (even on error)
        lab.set(loss=0.01)                                       # change any setting while traffic flows
        argv = lab.exec_argv("dc-a", ["python", "-m", "prfaas", ...])

    topo = Topology(decode_dcs=2)                               # dc-a, and dc-b and dc-c on their own links
    with Lab(LinkSettings(rate="1gbit"), topo, {"dc-a:dc-c": LinkSettings(rate="1gbit", delay_ms=12.5)}) as lab:
        lab.set("dc-a:dc-c", cut=True)                           # that link only; without a name: every link

Ownership: ``up`` creates the namespaces and starts one delayer per delayed link (detached processes, so that the
lab outlives the CLI command that made it); ``down`` stops the delayers and removes everything, and is safe to call
on a lab that is half built or already gone. A ``Lab`` learns how many decode datacenters the lab that is up has
from its saved state, so ``Lab()`` reaches every link of a lab made with ``--decode-dcs``. Failures raise
``LabUnavailable``; a failed ``up`` tears down what it built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from prfaas.errors import LabUnavailable
from prfaas.lab import state as lab_state
from prfaas.lab import topology
from prfaas.lab.spec import MAX_DECODE_DCS, LinkSettings, Topology, Wire
from prfaas.lab.system import require_support

DELAYER_START_S = 10.0
DELAYER_STOP_S = 5.0


class Lab:
    def __init__(self, link: LinkSettings | None = None, topo: Topology | None = None,
                 links: Mapping[str, LinkSettings] | None = None) -> None:
        """``link``: the settings every link starts with; ``links``: per-link settings by name, which win. Without
        ``topo``: the default lab's, with as many decode datacenters as the one that is up."""
        self.topo = topo or lab_state.running(Topology())
        self.link = link or LinkSettings()  # link 0's settings (the two-datacenter lab's only link)
        self.initial = {wire.name: (links or {}).get(wire.name, self.link) for wire in self.topo.wires}
        for name in links or {}:
            self.topo.wire(name)  # an unknown name is refused before anything is built

    def __enter__(self) -> Lab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Build the lab with the initial settings; refuses (``LabUnavailable``) when one is already up."""
        require_support()
        if topology.exists(self.topo):
            raise LabUnavailable(f"a lab is already up ({', '.join(self.topo.namespaces)}); "
                                 "run `prfaas lab down` first")
        try:
            topology.create(self.topo)
            lab_state.save(self.topo, lab_state.LabState(
                links={wire.name: lab_state.LinkState() for wire in self.topo.wires},
                decode_dcs=self.topo.decode_dcs, created=time.time()))
            self._apply(self.initial)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Stop the delayers and remove the namespaces, veths and state; quiet about parts already gone."""
        saved = lab_state.load(self.topo)
        self._adopt(saved)
        for link in (saved.links.values() if saved else ()):
            if link.delayer_pid:
                _stop_delayer(link.delayer_pid)
        every = self.topo.with_decode_dcs(MAX_DECODE_DCS)  # also what a lab that lost its state left behind
        topology.destroy(every)
        lab_state.remove(every)

    def set(self, link_name: str | None = None, **changes: Any) -> LinkSettings:
        """Change settings (``rate``, ``delay_ms``, ``jitter_ms``, ``loss``, ``mtu``, ``cut``; None keeps one) of
        link ``link_name``, or of every link without one; returns the (first) changed link's settings."""
        saved = self._saved()
        targets = {name: saved.links[name].settings.replace(**changes) for name in self.link_names(link_name)}
        self._apply(targets)
        return next(iter(targets.values()))

    def current(self, link_name: str | None = None) -> LinkSettings:
        """The settings of a link of the lab that is up, link 0 by default (``LabUnavailable`` when none is)."""
        saved = self._saved()
        return saved.links[self.link_names(link_name)[0]].settings

    def reset(self, link: LinkSettings, link_name: str | None = None) -> None:
        """Replace every setting at once (``set`` changes only those it names), of one link or of all."""
        self._saved()
        self._apply({name: link for name in self.link_names(link_name)})

    def reset_each(self, links: Mapping[str, LinkSettings]) -> None:
        """Replace every setting of each link named in ``links`` with its own (``reset`` gives them all one);
        the links not named keep theirs."""
        self._saved()
        self._apply({self.topo.wire(name).name: link for name, link in links.items()})

    def link_names(self, link_name: str | None = None) -> list[str]:
        """``link_name`` as this lab names it (``dc-c`` is ``dc-a:dc-c``), or every link's name without one."""
        self._adopt(lab_state.load(self.topo))
        return [self.topo.wire(link_name).name] if link_name else [wire.name for wire in self.topo.wires]

    def status(self) -> dict[str, Any]:
        """Whether the lab is up and, per link, its settings, delayer and kernel state; ``link``, ``delayer`` and
        ``kernel`` at the top repeat link 0's (the two-datacenter lab's only link)."""
        saved = lab_state.load(self.topo)
        self._adopt(saved)
        up = topology.exists(self.topo)
        links = {wire.name: self._link_status(wire, saved, up) for wire in self.topo.wires}
        first = links[self.topo.wires[0].name]
        return {"up": up, "namespaces": self.topo.namespaces, "router_address": self.topo.public_b,
                "link": first["settings"], "delayer": first["delayer"], "kernel": first["kernel"], "links": links}

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (``ip netns exec`` execs it: the pid stays the same)."""
        return ["ip", "netns", "exec", ns, *argv]

    def _link_status(self, wire: Wire, saved: lab_state.LabState | None, up: bool) -> dict[str, Any]:
        link = saved.links.get(wire.name) if saved else None
        pid = link.delayer_pid if link else None
        return {"settings": link.settings.to_json() if link else None, "router_address": wire.public,
                "wan": [wire.wan_a, wire.wan_b], "delayer": {"pid": pid, "running": bool(pid and _is_delayer(pid))},
                "kernel": topology.describe(self.topo, wire) if up else {}}

    def _adopt(self, saved: lab_state.LabState | None) -> None:
        """Take the number of decode datacenters from the lab that is up."""
        if saved and saved.decode_dcs != self.topo.decode_dcs:
            self.topo = self.topo.with_decode_dcs(saved.decode_dcs)

    def _saved(self) -> lab_state.LabState:
        saved = lab_state.load(self.topo)
        self._adopt(saved)
        if saved is None or not topology.exists(self.topo):
            raise LabUnavailable("no lab is up; run `prfaas lab up` first")
        for name in (wire.name for wire in self.topo.wires):
            saved.links.setdefault(name, lab_state.LinkState())
        return saved

    def _apply(self, targets: Mapping[str, LinkSettings]) -> None:
        """Give each target link its settings; the other links keep theirs."""
        saved = self._saved()
        for name, link in targets.items():
            self._retire_delayer(saved, name, link)
        for name, link in targets.items():
            state = saved.links[name]
            if link.delayed and state.delayer_pid is None:
                state.delayer_pid = self._start_delayer(self.topo.wire(name), link)
                lab_state.save(self.topo, saved)
            state.settings = link
        topology.apply(self.topo, _settings(saved))
        lab_state.save(self.topo, saved)
        self.link = saved.links[self.topo.wires[0].name].settings

    def _retire_delayer(self, saved: lab_state.LabState, name: str, link: LinkSettings) -> None:
        """A delay queue gets its reader before its rule and loses its rule before its reader. A change of delay
        restarts the link's delayer: that link's packets pass undelayed for that moment."""
        state = saved.links[name]
        same = (state.settings.delay_ms, state.settings.jitter_ms) == (link.delay_ms, link.jitter_ms)
        if not state.delayer_pid or (same and link.delayed and _is_delayer(state.delayer_pid)):
            return
        state.settings = dataclasses.replace(state.settings, delay_ms=0.0, jitter_ms=0.0)
        topology.apply(self.topo, _settings(saved))
        _stop_delayer(state.delayer_pid)
        state.delayer_pid = None
        lab_state.save(self.topo, saved)

    def _start_delayer(self, wire: Wire, link: LinkSettings) -> int:
        ready = lab_state.path(self.topo, f"{wire.index}.ready")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready)
        cmd = [sys.executable, "-m", "prfaas.lab.delayer", "--ns", self.topo.ns_a, "--ns", wire.ns,
               "--queue", str(topology.queue_of(wire)), "--delay-ms", str(link.delay_ms),
               "--jitter-ms", str(link.jitter_ms), "--ready", ready]
        log = open(lab_state.path(self.topo, "log"), "ab")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + DELAYER_START_S
        while time.monotonic() < deadline and proc.poll() is None and not os.path.exists(ready):
            time.sleep(0.02)
        if not os.path.exists(ready):
            proc.kill()
            proc.wait()
            raise LabUnavailable(f"the delayer of {wire.name} did not start; see {lab_state.path(self.topo, 'log')}")
        return proc.pid


def _settings(saved: lab_state.LabState) -> dict[str, LinkSettings]:
    return {name: link.settings for name, link in saved.links.items()}


def _is_delayer(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"prfaas.lab.delayer" in f.read()
    except OSError:
        return False


def _stop_delayer(pid: int) -> None:
    """SIGTERM (it lets held packets through), SIGKILL after a grace period; only if the pid is still ours."""
    if not _is_delayer(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + DELAYER_STOP_S
    while _is_delayer(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)
    if _is_delayer(pid):
        os.kill(pid, signal.SIGKILL)
