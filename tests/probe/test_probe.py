"""The probe on loopback only (127.0.0.1), with short bounded runs."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from prfaas.cli import app
from prfaas.errors import Unreachable
from prfaas.probe import ProbeServer, run_probe
from prfaas.probe.client import ProbeConfig
from prfaas.probe.stats import jitter, percentile

LOOPBACK = "127.0.0.1"
QUICK = ProbeConfig(streams=2, warmup_s=0.2, seconds=0.5, rtt_count=30, udp_count=100, udp_interval_s=0.0005)


@pytest.fixture
def server() -> Iterator[ProbeServer]:
    with ProbeServer(LOOPBACK, 0, max_seconds=60) as srv:
        yield srv


def test_loopback_measures_everything(server: ProbeServer) -> None:
    seen: set[str] = set()
    r = run_probe(LOOPBACK, server.port, QUICK, lambda name, frac: seen.add(name))
    assert seen == {"rtt", "bandwidth", "loss", "mtu"}
    assert r.bandwidth_bps > 1e8  # loopback moves far more than 100 Mbit/s
    assert len(r.per_stream_bps) == 2 and all(b > 0 for b in r.per_stream_bps)
    assert 0 < r.rtt_min_ms <= r.rtt_p50_ms <= r.rtt_p99_ms <= r.rtt_max_ms < 1000
    assert r.rtt_samples == 30
    assert r.loss == 0.0 and r.udp_received == 100
    assert r.mtu >= 1500


def test_unreachable_says_it_cannot_connect() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    with pytest.raises(Unreachable, match="cannot connect to a probe server"):
        run_probe(LOOPBACK, port, QUICK)


def test_server_stops_by_itself() -> None:
    srv = ProbeServer(LOOPBACK, 0, max_seconds=0.3).start()
    srv.wait()
    assert not srv.running()


def test_stats() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0
    assert jitter([1.0, 2.0, 1.0]) == 1.0
    assert jitter([5.0]) == 0.0


def test_cli_json_feeds_plan_link(server: ProbeServer, tmp_path: object) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["probe", "run", f"{LOOPBACK}:{server.port}", "--streams", "2", "--warmup",
                              "0.2s", "--duration", "0.5s", "--rtt-count", "20", "--udp-count", "50", "--json"])
    assert res.exit_code == 0, res.output
    link = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"bandwidth_bps", "rtt_p50_ms", "rtt_p99_ms", "jitter_ms", "loss", "mtu"} <= set(link)
    from pathlib import Path

    path = Path(str(tmp_path)) / "link.json"
    path.write_text(json.dumps(link))
    fixture = Path(__file__).parents[1] / "plan" / "fixtures" / "llama-3.2-1b.json"
    res = runner.invoke(app, ["plan", "link", "--config", str(fixture), "--link", str(path), "--seq-len",
                              "1024,8192", "--qps", "1", "--ttft-budget-ms", "1000", "--json"])
    assert res.exit_code == 0, res.output
    verdict = json.loads(res.stdout.strip().splitlines()[-1])
    assert verdict["link"]["bandwidth_bps"] == link["bandwidth_bps"]
    assert verdict["verdict"] in ("feasible", "marginal")


def test_cli_bad_target() -> None:
    res = CliRunner().invoke(app, ["probe", "run", "nohostport", "--json"])
    assert res.exit_code != 0
