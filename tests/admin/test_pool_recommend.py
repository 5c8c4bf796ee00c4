"""`prfaas admin recommend` sizes a shared prefill pool from the sum of its client clusters' signals."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from prfaas.admin.recommend import combine, recommend
from prfaas.cli import app
from prfaas.plan.profile import SpeedProfile
from tests.admin.test_check import PROFILE, SIGNALS

# two clusters that together send SIGNALS' traffic, half each
EAST = {**SIGNALS, "requests": 120, "arrival_rps": 2.0, "prompt_lengths": {"128": 75, "4096": 45}}
WEST = {**EAST}


def test_the_pool_is_sized_from_the_sum_of_its_clients() -> None:
    merged = combine([EAST, WEST])
    assert merged["arrival_rps"] == 4.0 and merged["prompt_lengths"] == {"128": 150.0, "4096": 90.0}
    assert merged["instances"] == {"prefill": 1, "decode": 2} and merged["clusters"] == 2  # one pool, two clusters
    profile = SpeedProfile.from_json(PROFILE)
    pooled = recommend(merged, profile, link_bps=10e9)
    assert pooled.prefill_instances == recommend(SIGNALS, profile, link_bps=10e9).prefill_instances == 5
    # sized one cluster at a time, each would round up on its own: ⌈1.5 / 0.7⌉ = 3 each, 6 in all
    assert recommend(EAST, profile, link_bps=10e9).prefill_instances == 3
    assert combine([EAST]) is EAST


def test_recommend_takes_one_signals_file_per_cluster(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    for name, signals in (("east", EAST), ("west", WEST)):
        (tmp_path / f"{name}.json").write_text(json.dumps(signals))
    result = CliRunner().invoke(app, ["admin", "recommend", "--profile", str(tmp_path / "p.json"), "--signals",
                                      str(tmp_path / "east.json"), "--signals", str(tmp_path / "west.json"),
                                      "--link", "10gbit", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["prefill_instances"] == 5
