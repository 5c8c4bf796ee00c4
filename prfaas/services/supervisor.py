"""Supervision of ``prfaas up``'s role processes: a role that fails is started again, with back-off.

``prfaas up`` is a whole deployment in one command, so it does for its children what systemd
(``Restart=on-failure``, deploy/systemd) and Kubernetes do for ``prfaas serve``:

- Which exits are failures: a non-zero exit code, or death by a signal other than SIGHUP, SIGINT, SIGTERM and
  SIGPIPE (systemd's clean signals). A drained instance exits 0 (or by its re-raised SIGTERM when a second SIGTERM
  forced it) and is not restarted: someone chose to stop it.
- Back-off: the n-th failure in a row waits ``first_delay_s`` × 2^(n-1), at most ``max_delay_s``. A role that ran
  ``stable_s`` before failing starts the count again, so one crash a day never waits long.
- Crash loop: after ``max_restarts`` failures in a row the supervisor gives up on that role and says so; the rest
  keep running (the router routes around a missing instance). ``max_restarts`` 0 restarts nothing.
- A restart runs the same command line: the same instance id and, for the router, the same port. Instances pick
  new HTTP and KV ports and announce them in their next heartbeat; the router dials what its registry holds, so
  prefill and decode reach a restarted relay at its new address, and a restarted router relearns every instance
  from the heartbeats.

The supervisor only acts inside ``check()``; its owner stops calling it at shutdown, so nothing restarts then.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from prfaas.errors import InvalidRequest

_PR_SET_PDEATHSIG = 1
CLEAN_SIGNALS = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE})


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a failed role is started again (see the module docstring)."""

    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_s: float = 60.0
    max_restarts: int = 10

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise InvalidRequest("restart delays must satisfy 0 < first_delay_s <= max_delay_s")
        if self.stable_s <= 0:
            raise InvalidRequest("stable_s must be positive")
        if self.max_restarts < 0:
            raise InvalidRequest("--max-restarts must be 0 or more (0: never restart)")

    def delay_s(self, failures: int) -> float:
        """The wait before restarting after the ``failures``-th failure in a row (1 for the first)."""
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** (failures - 1))


def die_with_parent() -> None:
    """``preexec_fn`` for a child process: the kernel sends it SIGTERM when its parent dies (Linux), so no child
    outlives the process that started it."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def failed(returncode: int) -> bool:
    """Whether an exit asks for a restart: systemd's ``Restart=on-failure`` rule (a negative code is a signal)."""
    return returncode != 0 and -returncode not in CLEAN_SIGNALS


class Role:
    """One role process of the deployment: its name (``relay relay-0``), how to start it, and its restart record.
    ``spawn`` starts a fresh process with the role's command line each time it is called."""

    def __init__(self, name: str, spawn: Callable[[], subprocess.Popen[bytes]], clock: Callable[[], float]) -> None:
        self.name = name
        self.spawn = spawn
        self.process = spawn()
        self.started_at = clock()
        self.failures = 0  # in a row; back to 0 once the role has stayed up stable_s
        self.restarts = 0  # in all
        self.restart_at: float | None = None  # a restart is due then
        self.done = False  # exited and not to be restarted (clean exit, or given up)


class Supervisor:
    """Watches ``roles`` and restarts the failed ones by ``policy``; every decision is one line through ``say``."""

    def __init__(self, roles: list[Role], policy: RestartPolicy, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.roles = roles
        self.policy = policy
        self.say = say
        self.clock = clock

    def check(self) -> None:
        """One pass, without blocking: notice exits, schedule restarts, start those that are due."""
        now = self.clock()
        for role in self.roles:
            if role.done:
                continue
            if role.restart_at is not None:
                if now >= role.restart_at:
                    self._restart(role, now)
            elif role.process.poll() is not None:
                self._exited(role, now)

    def restarts(self) -> dict[str, int]:
        """Restarts so far, by role name, of the roles restarted at least once."""
        return {role.name: role.restarts for role in self.roles if role.restarts}

    def _exited(self, role: Role, now: float) -> None:
        code = role.process.returncode
        if not failed(code):
            role.done = True
            self.say(f"{role.name} exited with code {code} (a clean stop); not restarted")
            return
        role.failures = 1 if now - role.started_at >= self.policy.stable_s else role.failures + 1
        if role.failures > self.policy.max_restarts:
            role.done = True
            limit = self.policy.max_restarts
            verdict = f"giving up on it after {limit} restarts in a row" if limit else "not restarted"
            self.say(f"{role.name} exited with code {code}; {verdict} (--max-restarts {limit})")
            return
        delay = self.policy.delay_s(role.failures)
        role.restarts += 1
        role.restart_at = now + delay
        self.say(f"{role.name} exited with code {code}; restarting in {delay:.1f} s (restart {role.restarts})")

    def _restart(self, role: Role, now: float) -> None:
        role.process = role.spawn()
        role.started_at, role.restart_at = now, None
        self.say(f"{role.name} restarted (pid {role.process.pid})")
