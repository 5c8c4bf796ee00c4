"""``prfaas up`` as a benchmark's child process: started, waited for until it says it is up, then its stdout (every
role's log lines) drained by a thread so no role ever blocks on a full pipe; stopped with SIGTERM. A benchmark
killed outright takes its deployment with it."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from prfaas.services.supervisor import die_with_parent

READY = "prfaas is up"


def start_up(args: list[str], log: Path | None = None, timeout_s: float = 600.0,
             cwd: Path | None = None) -> subprocess.Popen[str]:
    """``python -m prfaas up ARGS``, once it is up; its stderr appended to ``log`` (discarded without one).
    ``SystemExit`` with the log's last lines if it stops or stays silent for ``timeout_s``."""
    err = log.open("ab") if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen([sys.executable, "-m", "prfaas", "up", *args], stdout=subprocess.PIPE, stderr=err,
                                text=True, cwd=cwd, preexec_fn=die_with_parent)
    finally:
        if log is not None:
            err.close()  # type: ignore[union-attr]  # the child holds its own descriptor
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_drain, args=(proc, lines), name="prfaas-up-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:  # it stopped
            break
        if READY in line:
            return proc
    stop_up(proc)
    tail = log.read_text(errors="replace").splitlines()[-20:] if log is not None else []
    raise SystemExit("the deployment did not come up" + "".join(f"\n{line}" for line in tail))


def _drain(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    """Every stdout line until the ready line goes to ``lines``; the rest is read and dropped; None at the end."""
    assert proc.stdout is not None
    ready = False
    for line in proc.stdout:
        if not ready:
            lines.put(line)
            ready = READY in line
    lines.put(None)


def stop_up(proc: subprocess.Popen[str], timeout_s: float = 120.0) -> None:
    """SIGTERM (each role drains and stops), SIGKILL if it has not stopped within ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
