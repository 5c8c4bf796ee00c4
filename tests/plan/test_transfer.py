"""The transfer model: a blob crosses a fresh TCP connection (handshake, slow start, then the link's rate), and the
serving path overlaps it with prefill; ``plan link`` uses it for the ``transfer_p99`` rule and reports the
predicted transfer stage and exposed transfer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prfaas.cli import app
from prfaas.config import TransferConfig
from prfaas.errors import InvalidRequest
from prfaas.kv.state import DEFAULT_CHUNK_BYTES
from prfaas.plan.lengths import LengthDist
from prfaas.plan.link import LinkSpec, transfer_ms
from prfaas.plan.transfer import (
    CHUNK_BYTES,
    INITIAL_WINDOW,
    PUSH_QUEUE_BYTES,
    PUSH_SLACK_BYTES,
    TCP_IP_OVERHEAD,
    UNSENT_BYTES,
    predict,
    wire_ms,
)
from prfaas.services import sinks
from prfaas.transfer import tcp
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


LAST = (1 << 20) * 8 / 1e9 * 1e3  # the last 1 MiB chunk at 1 Gbit/s, in ms


def test_decode_starts_when_prefill_answers_and_the_exposed_part_is_what_prefill_leaves() -> None:
    """Relay mode: the push's handshake and the relay's ack of the header come first and prefill answers the router
    once the blob exists, so decode's stage starts 2.5 RTT after prefill's; direct mode: prefill answers at once and
    decode's pull pays its own handshake and request."""
    wire = wire_ms(31_200_000, 1e9, 10)
    slow = predict(1024, 31_200_000, prefill_ms=2000, rate_bps=1e9, rtt_ms=10)
    # prefill outlasts the wire: the last chunk and its trip land before decode's 2.5 RTT head start runs out
    assert slow.stage_ms == pytest.approx(2000 + LAST + 5 - 25) and slow.exposed_ms == 0
    direct = predict(1024, 31_200_000, prefill_ms=2000, rate_bps=1e9, rtt_ms=10, mode="direct")
    assert direct.stage_ms == pytest.approx(2000 + LAST) and direct.exposed_ms == pytest.approx(LAST)
    fast = predict(1024, 31_200_000, prefill_ms=0, rate_bps=1e9, rtt_ms=10)
    assert fast.exposed_ms == pytest.approx(fast.stage_ms) == pytest.approx(wire + 10 - 25)
    assert predict(1024, 31_200_000, 0, 1e9, 10, mode="direct").stage_ms == pytest.approx(wire + 5)
    with pytest.raises(ValueError, match="mode"):
        predict(1024, 1, 0, 1e9, 10, mode="sideways")


def test_the_instance_prefill_is_the_pass_and_the_encoding_or_the_push_holding_it_back() -> None:
    """The engine thread encodes each layer's chunks between two layers, so the prefill an instance reports is the
    forward pass plus the encoding; in relay mode a blob larger than the push's slack (its queue and what its kernel
    may hold unsent) holds the engine until all but the slack has left over the link."""
    small = predict(1024, 31_200_000, prefill_ms=100, rate_bps=1e9, rtt_ms=10, encode_ms=40)
    assert small.instance_prefill_ms == 140 and small.exposed_ms == pytest.approx(small.stage_ms - 140)
    big = 200_000_000
    held = predict(16384, big, prefill_ms=100, rate_bps=1e9, rtt_ms=10, encode_ms=40)
    assert held.instance_prefill_ms == pytest.approx(wire_ms(big - PUSH_SLACK_BYTES, 1e9, 10) + 5)
    assert held.stage_ms == pytest.approx(wire_ms(big, 1e9, 10) + 10 - 25)
    direct = predict(16384, big, prefill_ms=100, rate_bps=1e9, rtt_ms=10, encode_ms=40, mode="direct")
    assert direct.instance_prefill_ms == 140  # the blob goes into prefill's own store: nothing holds it back


def test_the_models_constants_are_the_data_planes() -> None:
    assert CHUNK_BYTES == DEFAULT_CHUNK_BYTES == TransferConfig().chunk_bytes
    assert PUSH_QUEUE_BYTES == sinks.PUSH_QUEUE_BYTES
    assert UNSENT_BYTES == tcp.UNSENT_BYTES and PUSH_SLACK_BYTES == PUSH_QUEUE_BYTES + UNSENT_BYTES


def test_plan_link_reports_the_transfer_stage_with_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"model": "m", "prefill": [{"seq_len": 1024, "seconds": 0.1},
                                                             {"seq_len": 16384, "seconds": 1.6}],
                                   "kv": [{"seq_len": 1024, "codec": "none", "bytes": 1, "encode_seconds": 0.02},
                                          {"seq_len": 16384, "codec": "none", "bytes": 1, "encode_seconds": 0.1}]}))
    link = tmp_path / "link.json"
    link.write_text(json.dumps({"bandwidth_bps": 1e9, "rtt_p50_ms": 50, "rtt_p99_ms": 60}))
    args = ["plan", "link", "--config", str(KIMI), "--dtype", "bfloat16", "--link", str(link), "--profile",
            str(profile), "--mix", "hist:1024=1,4096=1,16384=1", "--qps", "0", "--ttft-budget-ms", "2000", "--json"]
    t = run_json(*args)["transfer"]
    assert t["overlap"] and t["mode"] == "relay" and [r["seq_len"] for r in t["per_length"]] == [1024, 4096, 16384]
    assert t["p50"]["seq_len"] == 4096 and t["p99"]["seq_len"] == 16384
    assert t["p50"]["kv_bytes"] == 55_967_744  # the synthetic engine's tensors (prfaas measure: tensor_bytes)
    assert t["p50"]["prefill_ms"] == pytest.approx(400) and t["p50"]["encode_ms"] == pytest.approx(36)
    assert t["p50"]["instance_prefill_ms"] == pytest.approx(436)
    assert t["p50"]["stage_ms"] == pytest.approx(wire_ms(55_967_744, 1e9, 50) + 50 - 125)
    assert t["p50"]["exposed_ms"] == pytest.approx(t["p50"]["stage_ms"] - t["p50"]["instance_prefill_ms"])
    exposed = {r["seq_len"]: r["exposed_ms"] for r in t["per_length"]}
    assert exposed[1024] > exposed[16384]  # the short prompt has less prefill to hide its wire behind
    assert t["over_mix"]["exposed_p99_ms"] == pytest.approx(max(exposed.values()) + 10)  # with the tail, P99 − P50
    assert t["over_mix"]["exposed_p99_ms"] > t["p99"]["exposed_ms"]  # the P99 over the mix, not the P99 length's
    assert t["over_mix"]["exposed_p50_ms"] == pytest.approx(exposed[4096])
    assert t["over_mix"]["stage_p50_ms"] == pytest.approx(t["p50"]["stage_ms"])
    direct = run_json(*args, "--mode", "direct")["transfer"]
    assert direct["p50"]["stage_ms"] == pytest.approx(wire_ms(55_967_744, 1e9, 50) + 25)
    assert direct["p50"]["instance_prefill_ms"] == pytest.approx(436)


def test_plan_link_refuses_an_unknown_mode() -> None:
    res = CliRunner().invoke(app, ["plan", "link", "--config", str(KIMI), "--bandwidth", "1gbit", "--rtt-ms", "5",
                                   "--qps", "1", "--ttft-budget-ms", "2000", "--mode", "sideways"])
    assert isinstance(res.exception, InvalidRequest) and "--mode must be one of relay, direct" in str(res.exception)


def test_a_quantile_over_the_mix_ranks_the_quantity_not_the_length() -> None:
    mix = LengthDist.of({1024: 0.6, 4096: 0.3, 16384: 0.1})
    exposed = [500.0, 100.0, 5.0]  # falls with length
    assert mix.quantile_of(exposed, 0.5) == 500.0 and mix.quantile(0.5) == 1024
    assert mix.quantile_of(exposed, 0.3) == 100.0  # 16384's 5 ms holds 10 %, 4096's 100 ms the next 30 %
    assert mix.quantile_of(exposed, 0.1) == 5.0 and mix.quantile_of(exposed, 0.99) == 500.0
