"""Per-link state: the bandwidth estimate, bytes in flight, learning from the router's outcomes."""

from __future__ import annotations

import random

import pytest

from prfaas.config import RouterConfig
from prfaas.messages import InstanceInfo
from prfaas.scheduler import Scheduler
from prfaas.scheduler.links import Bandwidth, Links, link_name
from tests.clock import Clock

MIB = 2**20
GBIT = 1e9



def test_link_bound_transfers_lower_the_estimate_and_ones_that_kept_up_restore_it_slowly() -> None:
    bw = Bandwidth(10 * GBIT)
    for _ in range(30):  # back-to-back deliveries of 100 MiB every 0.168 s: a 5 Gbit/s link
        bw.observe(100 * MIB, 100 * MIB * 8 / (5 * GBIT), exposed_s=1.0, chunk_bytes=4 * MIB)
    assert bw.estimate_bps == pytest.approx(5 * GBIT, rel=0.01)
    for _ in range(10):  # the transfers now end with their forward pass: the link had room for them, no more
        bw.observe(100 * MIB, 1.0, exposed_s=0.001, chunk_bytes=4 * MIB)
    assert 5.5 * GBIT < bw.estimate_bps < 7 * GBIT
    for _ in range(150):  # it keeps up: the link came back
        bw.observe(100 * MIB, 1.0, exposed_s=0.001, chunk_bytes=4 * MIB)
    assert bw.estimate_bps == pytest.approx(10 * GBIT, rel=0.01)
    bw.observe(100 * MIB, 0.001, exposed_s=1.0, chunk_bytes=4 * MIB)  # faster than provisioned: capped
    assert bw.estimate_bps <= 10 * GBIT


def test_the_gap_since_the_previous_delivery_is_what_the_link_spent() -> None:
    clock = Clock()
    link = Links(50, 0.99, 10 * GBIT, clock).get("dc-a", "dc-b")
    for i in range(40):  # a busy 2 Gbit/s link delivers 100 MiB every 0.42 s; each transfer waited ~2 s exposed
        clock.now = i * 100 * MIB * 8 / (2 * GBIT)
        link.transfer_done(100 * MIB, exposed_s=2.0, chunk_bytes=4 * MIB)
    assert link.bandwidth.estimate_bps == pytest.approx(2 * GBIT, rel=0.02)
    assert link_name(link.key) == "dc-a:dc-b" and link_name(("", "")) == "-:-"


def test_a_link_bound_blob_is_timed_from_the_forward_pass_it_streamed_beside() -> None:
    clock = Clock()
    link = Links(50, 0.99, 10 * GBIT, clock).get("dc-a", "dc-b")
    for i in range(40):  # 1 Gbit/s: 250 MiB take 2.1 s, streamed beside a 1.5 s forward pass, 0.6 s exposed
        clock.now = 100.0 * (i + 1)  # one at a time: no earlier delivery bounds the time
        link.transfer_done(250 * MIB, exposed_s=250 * MIB * 8 / GBIT - 1.5, chunk_bytes=4 * MIB, prefill_s=1.5)
    assert link.bandwidth.estimate_bps == pytest.approx(1 * GBIT, rel=0.02)  # not 250 MiB over the exposed 0.6 s


def test_the_router_tracks_bytes_in_flight_per_link_until_the_first_token() -> None:
    s = Scheduler(RouterConfig(offload_threshold_tokens=0), "direct", random.Random(0))
    decode = InstanceInfo(instance_id="d", role="decode", url="http://d", datacenter="dc-b",
                          kv_bytes_per_token=1000)
    prefills = [InstanceInfo(instance_id="p", role="prefill", url="http://p", datacenter="dc-a")]
    ticket = s.begin(s.route(500, prefills, [], decode=decode, home="dc-b"), decode, 500)
    link = s.links.get("dc-a", "dc-b")
    assert link.inflight_bytes == 500_000 and link.started_bytes() == 500_000
    s.transfer_done(ticket, ok=True, kv_bytes=500_000, exposed_s=0.002)
    ticket.close()
    assert link.inflight_bytes == 0 and link.monitor.health().samples == 1
    assert s.links.get("dc-a", "dc-c").inflight_bytes == 0  # another cluster's link is another link
    stats = link.stats()
    assert stats["link"] == "dc-a:dc-b" and stats["degraded"] is False
