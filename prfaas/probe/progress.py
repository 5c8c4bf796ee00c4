"""The probe's progress display (rich, on stderr so ``--json`` stdout stays one clean line)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from prfaas.probe.client import ProbeResult
from prfaas.terminal import console

STEPS = ("rtt", "bandwidth", "loss", "mtu")


@contextmanager
def probe_progress() -> Iterator[Callable[[str, float], None]]:
    with Progress(TextColumn("{task.description:>10}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=False) as bar:
        tasks: dict[str, TaskID] = {name: bar.add_task(name, total=1.0) for name in STEPS}

        def step(name: str, fraction: float) -> None:
            bar.update(tasks[name], completed=fraction)

        yield step


def render_result(r: ProbeResult) -> None:
    t = Table("measure", "value")
    t.add_row("bandwidth", f"{r.bandwidth_bps / 1e9:.3f} Gbps over {r.streams} streams ({r.seconds:g} s)")
    t.add_row("RTT P50 / P99", f"{r.rtt_p50_ms:.3f} / {r.rtt_p99_ms:.3f} ms ({r.rtt_samples} samples)")
    t.add_row("jitter", f"{r.jitter_ms:.3f} ms")
    t.add_row("loss", f"{r.loss:.3%} ({r.udp_received}/{r.udp_sent} UDP echoed)")
    t.add_row("path MTU", f"{r.mtu} ({r.mtu_source})")
    console().print(t)
