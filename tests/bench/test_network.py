"""Network conditions during a run: recurring cuts through a real lab (root only), the link always restored."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from prfaas.bench.matrix import Network
from prfaas.bench.network import NetworkControl
from prfaas.errors import InvalidRequest
from prfaas.lab import Lab, LinkSettings, Topology, missing_support

REASON = missing_support()


def test_a_recurring_cut_must_leave_the_link_up_between_cuts() -> None:
    with pytest.raises(InvalidRequest, match="cut_every_s"):
        Network(cut_s=2.0, cut_every_s=2.0)


@pytest.mark.skipif(REASON is not None, reason=f"lab unavailable here: {REASON}")
def test_a_soak_cuts_the_link_again_every_interval_and_restores_it() -> None:
    topo = Topology.numbered(8)
    Lab(topo=topo).down()
    with Lab(LinkSettings(rate="100mbit"), topo) as lab:
        control = NetworkControl(Network(cut_at_s=0.2, cut_s=0.3, cut_every_s=0.8), topo=topo)
        assert control.available

        async def soak() -> list[tuple[float, float]]:
            ended = asyncio.Event()
            epoch = time.perf_counter()
            cuts = asyncio.create_task(control.cut_during(epoch, ended))
            await asyncio.sleep(2.0)  # the cell's requests
            ended.set()
            return await cuts

        windows = asyncio.run(soak())
        assert len(windows) == 3  # at 0.2, 1.0 and 1.8 s
        assert all(0.25 <= end - start <= 1.0 for start, end in windows)
        assert all(b[0] - a[0] >= 0.7 for a, b in itertools.pairwise(windows))
        assert not lab.current().cut
        control.close()
    assert Lab(topo=topo).status()["up"] is False


def test_delay_cells_may_run_at_their_own_rate() -> None:
    control = NetworkControl(Network(rate="10gbit", delay_rate="1gbit"))
    assert control.settings("delay").rate == "1gbit" and control.settings("delay").delay_ms == 10.0
    assert {control.settings(c).rate for c in ("normal", "loss", "cut")} == {"10gbit"}
    assert NetworkControl(Network(rate="2gbit")).settings("delay").rate == "2gbit"
