"""A benchmark's cores cut in two: one half for the engines, the other for everything around them.

On a machine of a few cores a system's HTTP front end, its router and the load's clients run on the cores its
engine's OpenMP threads need, and every time one of those threads is descheduled the others wait for it at the next
barrier: the figure then measures how the processes share the cores as much as the systems. ``CoreSplit`` gives the
engine processes one half and the rest the other, each engine with a thread per core of its half, as a deployment
gives its engines hardware of their own (a GPU, a host). Linux only (``sched_setaffinity``); threads a pinned thread
starts later inherit its cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CoreSplit:
    """``engines``: the cores of the engine processes; ``rest``: the cores of every other process."""

    engines: frozenset[int]
    rest: frozenset[int]

    @classmethod
    def halves(cls) -> CoreSplit:
        """The cores this process may use, the first half for the engines (at least 2 cores)."""
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            raise ValueError(f"splitting the cores needs at least 2, this process has {len(cores)}")
        half = len(cores) // 2
        return cls(frozenset(cores[:half]), frozenset(cores[half:]))

    @property
    def threads(self) -> int:
        """An engine's OpenMP threads: one per core of its half."""
        return len(self.engines)

    def env(self) -> dict[str, str]:
        """The environment of a process whose engine runs on ``engines``."""
        return {"OMP_NUM_THREADS": str(self.threads)}

    def cpu_list(self) -> str:
        """``engines`` as a CPU list (``0-3``, or ``0,2,5`` where they are not contiguous)."""
        cores = sorted(self.engines)
        if cores[-1] - cores[0] == len(cores) - 1:
            return f"{cores[0]}-{cores[-1]}"
        return ",".join(map(str, cores))

    def place(self, root: int, on_engines: Callable[[list[str]], bool]) -> None:
        """Pin every thread of ``root`` and its descendants: to ``engines`` where ``on_engines`` says so of the
        process's command line, else to ``rest``."""
        import psutil

        top = psutil.Process(root)
        for proc in [top, *top.children(recursive=True)]:
            pin(proc.pid, self.engines if on_engines(proc.cmdline()) else self.rest)

    def json(self) -> dict[str, Any]:
        return {"engines": sorted(self.engines), "rest": sorted(self.rest), "threads": self.threads}


def pin(pid: int, cores: frozenset[int]) -> None:
    """Every thread of process ``pid`` on ``cores`` (a thread that ends meanwhile is skipped)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:
            continue
