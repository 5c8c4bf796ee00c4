"""Supervision under ``prfaas up``: a killed role comes back with back-off, a clean stop stays stopped, a crash
loop is given up, and nothing is restarted or left behind at shutdown."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

import httpx
import pytest

from prfaas.errors import InvalidRequest
from prfaas.services.supervisor import RestartPolicy, Role, Supervisor, failed
from tests.clock import Clock
from tests.services.deploy import alive, deployment, descendants
from tests.services.test_faults import MODEL, complete, pid_of

BACK_WITHIN_S = 30.0



def python(code: str) -> Callable[[], subprocess.Popen[bytes]]:
    return lambda: subprocess.Popen([sys.executable, "-c", code])


def supervised(code: str, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic
               ) -> tuple[Supervisor, Role, list[str]]:
    said: list[str] = []
    role = Role("relay relay-0", python(code), clock)
    return Supervisor([role], policy, said.append, clock), role, said


def test_back_off_doubles_to_its_cap_and_clean_exits_are_not_failures() -> None:
    assert [RestartPolicy().delay_s(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert [failed(code) for code in (0, -signal.SIGTERM, -signal.SIGINT)] == [False] * 3  # drained, stopped
    assert [failed(code) for code in (-signal.SIGKILL, -signal.SIGSEGV, 1, 15)] == [True] * 4
    with pytest.raises(InvalidRequest):
        RestartPolicy(max_restarts=-1)


def test_a_crash_loop_is_given_up_after_max_restarts() -> None:
    sup, role, said = supervised("raise SystemExit(3)", RestartPolicy(first_delay_s=0.1, max_delay_s=0.2,
                                                                      max_restarts=3))
    deadline = time.monotonic() + 20
    while not role.done and time.monotonic() < deadline:
        sup.check()
        time.sleep(0.02)
    assert role.done and sup.restarts() == {"relay relay-0": 3}
    assert [line.split("; ", 1)[1] for line in said if "restarting" in line] == [
        "restarting in 0.1 s (restart 1)", "restarting in 0.2 s (restart 2)", "restarting in 0.2 s (restart 3)"]
    assert said[-1] == "relay relay-0 exited with code 3; giving up on it after 3 restarts in a row (--max-restarts 3)"


def test_a_clean_exit_is_not_restarted() -> None:
    sup, role, said = supervised("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", RestartPolicy())
    role.process.wait(10)
    sup.check()
    assert role.done and role.restart_at is None and sup.restarts() == {}
    assert said == ["relay relay-0 exited with code -15 (a clean stop); not restarted"]


def test_max_restarts_0_restarts_nothing() -> None:
    sup, role, said = supervised("raise SystemExit(1)", RestartPolicy(max_restarts=0))
    role.process.wait(10)
    sup.check()
    assert role.done and sup.restarts() == {}
    assert said == ["relay relay-0 exited with code 1; not restarted (--max-restarts 0)"]


def test_a_role_that_stayed_up_starts_its_back_off_again() -> None:
    clock = Clock()
    sup, role, said = supervised("import time; time.sleep(60)", RestartPolicy(first_delay_s=1, stable_s=10), clock)
    try:
        for up_for_s, delay in ((1, "1.0"), (1, "2.0"), (11, "1.0")):  # 11 s up: past stable_s, back to 1 s
            clock.now += up_for_s
            role.process.kill()
            role.process.wait(10)
            sup.check()
            assert said[-1].endswith(f"restarting in {delay} s (restart {role.restarts})"), said
            clock.now += 5
            sup.check()
            assert said[-1] == f"relay relay-0 restarted (pid {role.process.pid})"
    finally:
        role.process.kill()
        role.process.wait(10)


def _lines(stream: IO[str]) -> list[str]:
    """Collects what ``prfaas up`` prints from now on (a thread, so a quiet stdout never blocks the test)."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")), daemon=True).start()
    return lines


def _router_pid(up_pid: int) -> int:
    for pid in descendants(up_pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"\0router\0" in f.read():
                return pid
    raise AssertionError("no router process")


def _back(url: str, pid_now: Callable[[], int], old: int) -> None:
    """Waits until a new process serves in ``old``'s place and the router is ready again."""
    deadline = time.monotonic() + BACK_WITHIN_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, AssertionError, StopIteration):
            if pid_now() != old and httpx.get(f"{url}/health").status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"not back within {BACK_WITHIN_S:.0f} s (router /health "
                         f"{httpx.get(f'{url}/health').status_code})")


def test_killed_relay_decode_and_router_are_restarted_and_serve_remote_again() -> None:
    with deployment(MODEL, "relay", threshold=0) as (url, up):
        said = _lines(up.stdout)
        kills: list[tuple[str, Callable[[], int]]] = [
            ("relay relay-0", lambda: pid_of(url, "relay-0")), ("decode decode-0", lambda: pid_of(url, "decode-0")),
            ("router", lambda: _router_pid(up.pid))]
        for name, pid_now in kills:
            old = pid_now()
            os.kill(old, signal.SIGKILL)
            _back(url, pid_now, old)
            reply = complete(url, f"after the {name} came back")
            assert reply.status_code == 200, reply.text
            assert reply.json()["prfaas"]["route"] == "remote", reply.json()["prfaas"]
            assert f"prfaas up: {name} exited with code -9; restarting in 0.5 s (restart 1)\n" in said
        everything = descendants(up.pid)
    deadline = time.monotonic() + 5
    while not any("prfaas stopped" in line for line in said) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert said[-1] == ("prfaas stopped: every process has exited; restarts: router 1, relay relay-0 1, "
                        "decode decode-0 1\n"), said
    assert not [pid for pid in everything if alive(pid)]  # the restarted ones too
