"""Network conditions through the lab during a run: set per cell, the cut scheduled inside its cell.

``NetworkControl`` owns nothing it did not set: ``close`` puts back the settings each link had before the run,
every link its own (a three-datacenter lab's links differ). A cell's condition goes on the link of the target's
datacenter when the target is a lab router (its address is a decode datacenter's), so another cluster's link
keeps its own settings; a target outside the lab (a loopback URL) gets every link set alike, as it cannot be
told which link it uses. Without a lab that is up (or without root) every condition but ``normal`` is skipped,
with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from urllib.parse import urlsplit

from prfaas.bench.matrix import Network
from prfaas.errors import LabUnavailable
from prfaas.lab.lab import Lab
from prfaas.lab.spec import LinkSettings, Topology


class NetworkControl:
    def __init__(self, network: Network, topo: Topology | None = None, target: str = "") -> None:
        """``target``: the URL the run measures; its host picks the link the cells change."""
        self.network = network
        self.lab: Lab | None = None
        self.saved: dict[str, LinkSettings] = {}  # every link's settings before the run, by name
        self.link_name: str | None = None  # the link the cells change; None: every link
        self.reason = ""
        try:
            lab = Lab(topo=topo)
            self.saved = {name: lab.current(name) for name in lab.link_names()}
            self.link_name = _link_of(lab, target)
            self.lab = lab
        except LabUnavailable as exc:
            self.reason = f"no lab: {exc.message}"

    @property
    def available(self) -> bool:
        return self.lab is not None

    def settings(self, condition: str) -> LinkSettings:
        n = self.network
        before = self.saved.get(self.link_name) if self.link_name else next(iter(self.saved.values()), None)
        base = LinkSettings(rate=n.rate, mtu=before.mtu if before else 1500)
        if condition == "delay":
            return dataclasses.replace(base, rate=n.delay_rate or n.rate, delay_ms=n.delay_ms, jitter_ms=n.jitter_ms)
        if condition == "loss":
            return dataclasses.replace(base, loss=n.loss)
        return base

    def apply(self, condition: str) -> LinkSettings | None:
        """Set the lab for ``condition`` (the cut itself comes from ``cut_during``)."""
        if self.lab is None:
            return None
        link = self.settings(condition)
        self.lab.reset(link, self.link_name)
        return link

    async def cut_during(self, epoch: float, until: asyncio.Event) -> list[tuple[float, float]]:
        """Cut the WAN ``cut_at_s`` into the cell for ``cut_s``, and again every ``cut_every_s`` until ``until``
        is set; return the windows (run-relative seconds). The link is always restored, also when cancelled."""
        assert self.lab is not None
        n, windows = self.network, list[tuple[float, float]]()
        began = time.perf_counter()
        wait = n.cut_at_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), max(0.0, began + wait - time.perf_counter()))
            if until.is_set() and windows:
                return windows
            start = time.perf_counter() - epoch
            await asyncio.to_thread(self.lab.set, self.link_name, cut=True)
            try:
                await asyncio.sleep(n.cut_s)
            finally:
                await asyncio.to_thread(self.lab.set, self.link_name, cut=False)
            windows.append((start, time.perf_counter() - epoch))
            if n.cut_every_s is None:
                return windows
            wait += n.cut_every_s

    def close(self) -> None:
        if self.lab is not None and self.saved:
            self.lab.reset_each(self.saved)


def _link_of(lab: Lab, target: str) -> str | None:
    """The link of the decode datacenter whose router address is ``target``'s host; None when none is."""
    host = urlsplit(target).hostname if target else None
    return next((wire.name for wire in lab.topo.wires if host and wire.public == host), None)
