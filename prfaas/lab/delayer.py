"""The lab's delay line: a user-space process that holds each WAN packet for ``delay ± jitter`` before letting it
through (this kernel has no ``netem``).

``python -m prfaas.lab.delayer --ns dc-a --ns dc-b --queue Q --delay-ms D --jitter-ms J --ready FILE`` binds
NFQUEUE ``Q`` (one link's queue: one delayer per delayed link) in each namespace (packets arriving over that WAN,
so the sender's TCP small-queue accounting is not involved), keeps one FIFO per queue, and accepts packets in
batches when they are due. Jitter is uniform in ``[-J, +J]`` per packet; a packet never leaves before the one
ahead of it (no reordering, like netem with rate).

Limits: one Python process on a shared CPU: each packet costs a netlink message; GSO keeps packets large, so a
single bulk flow of about 1 Gbit/s gets through; timer precision is about 0.1 ms. On SIGTERM (or when a namespace
disappears, or after ``--max-hours``) it lets every held packet through and exits. Without it running, a queue with
rules drops its packets, so the link looks cut: ``prfaas lab status`` says whether it runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import random
import select
import signal
import time
from collections.abc import Iterator

from prfaas.lab.nfqueue import NfQueue

CLONE_NEWNET = 0x40000000
WATCH_INTERVAL_S = 1.0


@contextlib.contextmanager
def in_namespace(ns: str) -> Iterator[None]:
    """Run the body with this thread in namespace ``ns`` (sockets made there stay there), then come back."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
        yield
    finally:
        libc.setns(home, CLONE_NEWNET)
        os.close(home)
        os.close(target)


class DelayLine:
    """One queue's FIFO of (due time, packet id)."""

    def __init__(self, queue: NfQueue, delay_s: float, jitter_s: float, rng: random.Random) -> None:
        self.queue, self.delay_s, self.jitter_s, self.rng = queue, delay_s, jitter_s, rng
        self.held: collections.deque[tuple[float, int]] = collections.deque()
        self.last_due = 0.0

    def take(self, now: float) -> None:
        for packet_id in self.queue.read():
            due = now + self.delay_s + (self.rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0)
            self.last_due = max(due, self.last_due, now)
            self.held.append((self.last_due, packet_id))

    def release(self, now: float) -> None:
        last = None
        while self.held and self.held[0][0] <= now:
            last = self.held.popleft()[1]
        if last is not None:
            self.queue.accept_upto(last)

    def next_due(self) -> float | None:
        return self.held[0][0] if self.held else None

    def flush(self) -> None:
        if self.held:
            self.queue.accept_upto(self.held[-1][1])
            self.held.clear()


def serve(lines: list[DelayLine], namespaces: list[str], max_seconds: float) -> None:
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    started = next_watch = time.monotonic()
    by_fd = {line.queue.fileno(): line for line in lines}
    while not stop["now"] and time.monotonic() - started < max_seconds:
        now = time.monotonic()
        dues = [d for d in (line.next_due() for line in lines) if d is not None]
        timeout = min([WATCH_INTERVAL_S, *(max(0.0, d - now) for d in dues)])
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select(list(by_fd), [], [], timeout)
            now = time.monotonic()
            for fd in ready:
                by_fd[fd].take(now)
        for line in lines:
            line.release(time.monotonic())
        if now >= next_watch:
            next_watch = now + WATCH_INTERVAL_S
            if not all(os.path.exists(f"/run/netns/{ns}") for ns in namespaces):
                break
    for line in lines:
        line.flush()


def main(argv: list[str] | None = None) -> None:
    from prfaas.lab.topology import DELAY_QUEUE

    parser = argparse.ArgumentParser(prog="python -m prfaas.lab.delayer", description=__doc__.split("\n")[0])
    parser.add_argument("--ns", action="append", required=True, help="namespace whose WAN arrivals to delay")
    parser.add_argument("--queue", type=int, default=DELAY_QUEUE, help="the link's NFQUEUE number")
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--ready", required=True, help="file written once every queue is bound")
    parser.add_argument("--max-hours", type=float, default=12.0)
    args = parser.parse_args(argv)
    rng = random.Random()
    lines = []
    for ns in args.ns:
        with in_namespace(ns):
            queue = NfQueue(args.queue)
        lines.append(DelayLine(queue, args.delay_ms / 1e3, args.jitter_ms / 1e3, rng))
    with open(args.ready, "w") as f:
        f.write(str(os.getpid()))
    serve(lines, args.ns, args.max_hours * 3600)


if __name__ == "__main__":
    main()
