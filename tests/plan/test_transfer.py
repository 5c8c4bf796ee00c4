"""The transfer model: a blob crosses a fresh TCP connection (handshake, slow start, then the link's rate), and the
serving path overlaps it with prefill; ``plan link`` uses it for the ``transfer_p99`` rule and reports the
predicted transfer stage and exposed transfer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prfaas.plan.link import LinkSpec, transfer_ms
from prfaas.plan.transfer import INITIAL_WINDOW, TCP_IP_OVERHEAD, predict, wire_ms
from tests.plan.test_cli import FIX, run_json

MSS = 1500 - TCP_IP_OVERHEAD
KIMI = FIX / "kimi-linear-48b-a3b-instruct.json"


def test_a_long_fat_link_pays_the_slow_start_rounds() -> None:
    """1 Gbit/s over 50 ms of RTT: the window needs 9 rounds (IW10 doubling) to hold the 6.25 MB BDP, so a
    31.2 MB blob takes 0.72 s where bytes over bandwidth say 0.25 s (what the lab measured, docs/planning.md)."""
    ramp = INITIAL_WINDOW * MSS * (2**9 - 1)
    expected = 50 + 9 * 50 + (31_200_000 - ramp) / 125_000 + 25
    assert wire_ms(31_200_000, 1e9, 50) == pytest.approx(expected)
    link = LinkSpec(1e9, 50, 50)
    assert transfer_ms(31_200_000, link, 0.0) == pytest.approx(expected)  # the transfer_p99 rule's value


def test_a_p99_round_trip_is_paid_once_not_on_every_slow_start_round() -> None:
    """A lossy link's probe: RTT P50 50 ms, P99 300 ms (a retransmission). The P99 transfer is the typical one plus
    250 ms and the jitter, not nine rounds of 300 ms."""
    link = LinkSpec(1e9, 50, 300, jitter_ms=5)
    assert transfer_ms(31_200_000, link, 0.0) == pytest.approx(wire_ms(31_200_000, 1e9, 50) + 250 + 5)


def test_a_short_link_is_bytes_over_bandwidth_and_a_round_trip_and_a_half() -> None:
    assert wire_ms(125_000_000, 1e9, 0.1) == pytest.approx(1000 + 0.15, rel=1e-3)
    assert wire_ms(1, 0.0, 1) == float("inf")


def test_the_exposed_transfer_is_what_is_left_after_prefill() -> None:
    slow = predict(1024, 31_200_000, prefill_ms=2000, rate_bps=1e9, rtt_ms=10)
    # prefill outlasts the wire: only the last chunk and the trip of the request and of the last byte are exposed
    assert slow.exposed_ms == pytest.approx((4 << 20) * 8 / 1e9 * 1e3 + 10)
    fast = predict(1024, 31_200_000, prefill_ms=0, rate_bps=1e9, rtt_ms=10)
    assert fast.exposed_ms == pytest.approx(fast.stage_ms) == pytest.approx(fast.wire_ms + 5)


def test_plan_link_reports_the_transfer_stage_with_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"model": "m", "prefill": [{"seq_len": 1024, "seconds": 0.1},
                                                             {"seq_len": 16384, "seconds": 1.6}]}))
    link = tmp_path / "link.json"
    link.write_text(json.dumps({"bandwidth_bps": 1e9, "rtt_p50_ms": 50, "rtt_p99_ms": 60}))
    out = run_json("plan", "link", "--config", str(KIMI), "--dtype", "bfloat16", "--link", str(link), "--profile",
                   str(profile), "--mix", "hist:1024=1,4096=1,16384=1", "--qps", "0", "--ttft-budget-ms", "2000",
                   "--json")
    t = out["transfer"]
    assert t["overlap"] and [r["seq_len"] for r in t["per_length"]] == [1024, 4096, 16384]
    assert t["p50"]["seq_len"] == 4096 and t["p99"]["seq_len"] == 16384
    assert t["p50"]["kv_bytes"] == 55_967_744  # the synthetic engine's tensors (prfaas measure: tensor_bytes)
    assert t["p50"]["stage_ms"] == pytest.approx(25 + wire_ms(55_967_744, 1e9, 50))
    assert t["p99"]["exposed_ms"] == pytest.approx(t["p99"]["stage_ms"] - 1600)
