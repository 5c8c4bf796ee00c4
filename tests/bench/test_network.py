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


@pytest.mark.skipif(REASON is not None, reason=f"lab unavailable here: {REASON}")
def test_a_run_on_a_three_datacenter_lab_changes_its_targets_link_and_restores_each_link_to_its_own() -> None:
    topo = Topology.numbered(12, decode_dcs=2)
    Lab(topo=topo).down()
    [b, c] = topo.wires
    own = {b.name: LinkSettings(rate="200mbit"), c.name: LinkSettings(rate="50mbit", loss=0.001)}
    with Lab(LinkSettings(), topo, own) as lab:
        control = NetworkControl(Network(rate="1gbit", loss=0.02, cut_at_s=0.0, cut_s=1.0), topo=topo,
                                 target=f"http://{c.public}:8001")
        assert control.link_name == c.name
        assert control.apply("loss") == LinkSettings(rate="1gbit", loss=0.02)
        assert lab.current(c.name).loss == 0.02 and lab.current(b.name) == own[b.name]  # the other cluster's link

        async def cut() -> list[tuple[bool, bool]]:  # (b cut, c cut) while the cut is on
            task = asyncio.create_task(control.cut_during(time.perf_counter(), asyncio.Event()))
            seen = []
            while not task.done():
                seen.append((lab.current(b.name).cut, lab.current(c.name).cut))
                await asyncio.sleep(0.05)
            await task
            return seen

        seen = asyncio.run(cut())
        assert (False, True) in seen and all(not b_cut for b_cut, _ in seen), seen
        control.close()
        assert {name: lab.current(name) for name in own} == own
        anywhere = NetworkControl(Network(rate="1gbit"), topo=topo, target="http://127.0.0.1:8000")
        assert anywhere.link_name is None  # not a lab router: every link alike, each restored to its own after
        anywhere.apply("normal")
        assert {lab.current(name).rate for name in own} == {"1gbit"}
        anywhere.close()
        assert {name: lab.current(name) for name in own} == own
    assert Lab(topo=topo).status()["up"] is False


def test_delay_cells_may_run_at_their_own_rate() -> None:
    control = NetworkControl(Network(rate="10gbit", delay_rate="1gbit"))
    assert control.settings("delay").rate == "1gbit" and control.settings("delay").delay_ms == 10.0
    assert {control.settings(c).rate for c in ("normal", "loss", "cut")} == {"10gbit"}
    assert NetworkControl(Network(rate="2gbit")).settings("delay").rate == "2gbit"
