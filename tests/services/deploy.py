"""Start ``prfaas up`` as a real subprocess for end-to-end tests, and check that it leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every live process whose parent chain leads to ``pid`` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


@contextmanager
def deployment(model: str, mode: str, threshold: int = 64, extra: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> Iterator[tuple]:
    """``prfaas up`` with ``extra`` flags and ``env`` added to this process's environment; yields (router URL,
    process). With ``--tls`` the URL is https (its CA: ``tls_dir``)."""
    proc, url, log = _start(model, mode, threshold, extra, env)
    children: list[int] = []
    try:
        children = descendants(proc.pid)
        yield url, proc
    except BaseException:
        # what the deployment said, for the failure's report (pytest shows captured stderr); pread leaves the
        # offset the children write at alone
        size = os.fstat(log.fileno()).st_size
        said = os.pread(log.fileno(), 6000, max(0, size - 6000)).decode(errors="replace")
        print(f"prfaas up's log, its end:\n{said}", file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
        time.sleep(0.2)
        left = [p for p in children if os.path.exists(f"/proc/{p}") and alive(p)]
        assert not left, f"processes left behind: {left}"


def _start(model: str, mode: str, threshold: int, extra: tuple[str, ...],
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, IO[bytes]]:
    """``prfaas up`` on a free port, healthy. The port can be taken between ``free_port`` and the router's bind (an
    outgoing connection of an earlier test, say): ``prfaas up`` then refuses it, and another is tried."""
    for _ in range(3):
        port, log = free_port(), tempfile.TemporaryFile()  # noqa: SIM115 (closed by deployment())
        cmd = [sys.executable, "-m", "prfaas", "up", "--model", model, "--mode", mode, "--port", str(port),
               "--offload-threshold", str(threshold), *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, **env} if env else None)
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if "prfaas is up" in line or time.monotonic() > deadline:
                break
        url = f"{'https' if '--tls' in extra else 'http'}://127.0.0.1:{port}"
        if proc.poll() is None and _healthy(url):
            return proc, url, log
        proc.kill()
        proc.wait()
        log.seek(0)
        said = log.read().decode(errors="replace")
        log.close()
        if "cannot listen on" not in said and "address already in use" not in said.lower():
            raise AssertionError(f"the deployment did not come up (exit {proc.returncode}):\n{said[-3000:]}")
    raise AssertionError("no free port for the router in 3 tries")


def _healthy(url: str) -> bool:
    try:  # only whether it answers: a --tls deployment's CA is checked by the tests that use it
        return httpx.get(f"{url}/health", verify=False).status_code == 200
    except httpx.HTTPError:
        return False


def line_saying(proc: Any, text: str, timeout_s: float) -> str:
    """The first line of ``prfaas up``'s stdout (its supervisor's decisions) holding ``text``, among the lines not
    looked at yet."""
    lines = getattr(proc, "prfaas_lines", None)
    if lines is None:
        lines = proc.prfaas_lines = _Lines(proc.stdout)
    return lines.wait_for(text, timeout_s)


class _Lines:
    """A pipe's lines, read by a thread of their own. Waiting with ``select`` on the pipe misses a line that an
    earlier ``readline`` already pulled into the text buffer with the one before it (the supervisor prints a
    relay's restart and, later, a prefill's exit; both wait in the pipe until a test reads)."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: list[str] = []
        self._seen = 0
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), name="prfaas-up-stdout", daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> str:
        deadline, seen = time.monotonic() + timeout_s, []
        with self._changed:
            while True:
                while self._seen < len(self._lines):
                    line = self._lines[self._seen]
                    self._seen += 1
                    seen.append(line)
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"prfaas up never said {text!r} in {timeout_s} s: {seen}")
                self._changed.wait(left)


def tls_dir(proc: subprocess.Popen) -> Path:
    """The certificate directory of a ``prfaas up --tls`` deployment (``ca.pem``, ``<role>.pem``/``.key``): where
    its roles' ``--config`` files are."""
    for pid in descendants(proc.pid):
        with contextlib.suppress(OSError):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "--config" in args and (Path(args[args.index("--config") + 1]).parent / "ca.pem").exists():
                return Path(args[args.index("--config") + 1]).parent
    raise AssertionError("no role of this deployment runs with a TLS config")


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextmanager
def role_processes(commands: list[list[str]], url: str, start_s: float = 180.0) -> Iterator[None]:
    """Run ``commands`` (one ``prfaas serve`` role each, output discarded) until the router at ``url`` is healthy;
    on exit terminate them all and wait for each."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in commands]
    try:
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline and not _healthy(url):
            assert all(p.poll() is None for p in procs), "a role exited at start"
            time.sleep(0.2)
        assert _healthy(url), "the deployment did not come up"
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            assert proc.wait(timeout=60) is not None
