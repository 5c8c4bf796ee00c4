"""``Lab``: the Python API of the two-datacenter lab (the CLI and ``prfaas up --lab`` use it; so may benchmarks).

    with Lab(LinkSettings(rate="1gbit", delay_ms=10)) as lab:   # up on enter, down on exit (even on error)
        lab.set(loss=0.01)                                       # change any setting while traffic flows
        argv = lab.exec_argv("dc-a", ["python", "-m", "prfaas", ...])

Ownership: ``up`` creates the namespaces and starts the delayer (a detached process, so that the lab outlives
the CLI command that made it); ``down`` stops the delayer and removes everything, and is safe to call on a lab that
is half built or already gone. Failures raise ``LabUnavailable``; a failed ``up`` tears down what it built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Any

from prfaas.errors import LabUnavailable
from prfaas.lab import state as lab_state
from prfaas.lab import topology
from prfaas.lab.spec import LinkSettings, Topology
from prfaas.lab.system import require_support

DELAYER_START_S = 10.0
DELAYER_STOP_S = 5.0


class Lab:
    def __init__(self, link: LinkSettings | None = None, topo: Topology | None = None) -> None:
        self.topo = topo or Topology()
        self.link = link or LinkSettings()

    def __enter__(self) -> Lab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Build the lab with ``self.link``; refuses (``LabUnavailable``) when one is already up."""
        require_support()
        if topology.exists(self.topo):
            raise LabUnavailable(f"a lab is already up ({self.topo.ns_a}, {self.topo.ns_b}); "
                                 "run `prfaas lab down` first")
        try:
            topology.create(self.topo)
            lab_state.save(self.topo, lab_state.LabState(created=time.time()))
            self._apply(self.link)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Stop the delayer and remove the namespaces, veths and state; quiet about parts already gone."""
        saved = lab_state.load(self.topo)
        if saved and saved.delayer_pid:
            _stop_delayer(saved.delayer_pid)
        topology.destroy(self.topo)
        lab_state.remove(self.topo)

    def set(self, **changes: Any) -> LinkSettings:
        """Change settings (``rate``, ``delay_ms``, ``jitter_ms``, ``loss``, ``mtu``, ``cut``); None keeps one."""
        saved = self._saved()
        link = saved.link.replace(**changes)
        self._apply(link)
        return link

    def current(self) -> LinkSettings:
        """The settings of the lab that is up (``LabUnavailable`` when none is)."""
        return self._saved().link

    def reset(self, link: LinkSettings) -> None:
        """Replace every setting at once (``set`` changes only those it names)."""
        self._saved()
        self._apply(link)

    def status(self) -> dict[str, Any]:
        saved = lab_state.load(self.topo)
        up = topology.exists(self.topo)
        pid = saved.delayer_pid if saved else None
        return {"up": up, "namespaces": [self.topo.ns_a, self.topo.ns_b],
                "router_address": self.topo.public_b, "link": saved.link.to_json() if saved else None,
                "delayer": {"pid": pid, "running": bool(pid and _is_delayer(pid))},
                "kernel": topology.describe(self.topo) if up else {}}

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (``ip netns exec`` execs it: the pid stays the same)."""
        return ["ip", "netns", "exec", ns, *argv]

    def _saved(self) -> lab_state.LabState:
        saved = lab_state.load(self.topo)
        if saved is None or not topology.exists(self.topo):
            raise LabUnavailable("no lab is up; run `prfaas lab up` first")
        return saved

    def _apply(self, link: LinkSettings) -> None:
        """A delay queue gets its reader before its rule and loses its rule before its reader. A change of delay
        restarts the delayer: packets pass undelayed for that moment."""
        saved = self._saved()
        same = (saved.link.delay_ms, saved.link.jitter_ms) == (link.delay_ms, link.jitter_ms)
        running = bool(saved.delayer_pid and _is_delayer(saved.delayer_pid))
        if saved.delayer_pid and not (running and same and link.delayed):
            topology.apply(self.topo, dataclasses.replace(saved.link, delay_ms=0.0, jitter_ms=0.0))
            _stop_delayer(saved.delayer_pid)
            saved.delayer_pid = None
            lab_state.save(self.topo, saved)
        if link.delayed and saved.delayer_pid is None:
            saved.delayer_pid = self._start_delayer(link)
            lab_state.save(self.topo, saved)
        topology.apply(self.topo, link)
        saved.link = link
        lab_state.save(self.topo, saved)
        self.link = link

    def _start_delayer(self, link: LinkSettings) -> int:
        ready = lab_state.path(self.topo, "ready")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready)
        cmd = [sys.executable, "-m", "prfaas.lab.delayer", "--ns", self.topo.ns_a, "--ns", self.topo.ns_b,
               "--delay-ms", str(link.delay_ms), "--jitter-ms", str(link.jitter_ms), "--ready", ready]
        log = open(lab_state.path(self.topo, "log"), "ab")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + DELAYER_START_S
        while time.monotonic() < deadline and proc.poll() is None and not os.path.exists(ready):
            time.sleep(0.02)
        if not os.path.exists(ready):
            proc.kill()
            proc.wait()
            raise LabUnavailable(f"the delayer did not start; see {lab_state.path(self.topo, 'log')}")
        return proc.pid


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
