"""Resource use over a run, once a second: CPU and memory of this host, and bytes on the lab's WAN (dc-a's side).
Bounded by the run: ``stop`` ends it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psutil

from prfaas.lab.spec import Topology
from prfaas.lab.system import run


def wan_bytes(topo: Topology | None = None) -> tuple[int, int] | None:
    """(rx, tx) bytes of dc-a's WAN interface, None without a lab."""
    topo = topo or Topology()
    try:
        with open(f"/run/netns/{topo.ns_a}"):
            pass
    except OSError:
        return None
    out = run(["cat", f"/sys/class/net/{topo.wan_if}/statistics/rx_bytes",
               f"/sys/class/net/{topo.wan_if}/statistics/tx_bytes"], ns=topo.ns_a, check=False).split()
    return (int(out[0]), int(out[1])) if len(out) == 2 else None


class Sampler:
    def __init__(self, epoch: float, interval_s: float = 1.0) -> None:
        self.epoch, self.interval_s = epoch, interval_s
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        psutil.cpu_percent()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        last = await asyncio.to_thread(wan_bytes)
        while True:
            await asyncio.sleep(self.interval_s)
            now = await asyncio.to_thread(wan_bytes)
            sample: dict[str, Any] = {"t": round(time.perf_counter() - self.epoch, 2),
                                      "cpu_percent": psutil.cpu_percent(),
                                      "mem_used_mb": round(psutil.virtual_memory().used / 2**20)}
            if now and last:
                sample["wan_gbps"] = round(((now[0] - last[0]) + (now[1] - last[1])) * 8 / self.interval_s / 1e9, 4)
            last = now
            self.samples.append(sample)

    async def stop(self) -> list[dict[str, Any]]:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return self.samples
