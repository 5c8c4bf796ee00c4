"""`prfaas admin check` finds planted mismatches; `prfaas admin recommend` sizes pools from synthetic signals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from prfaas.admin.check import ERROR, WARN, check
from prfaas.admin.recommend import recommend
from prfaas.cli import app
from prfaas.kv import Fingerprint
from prfaas.plan.profile import SpeedProfile

FP = Fingerprint("m", "llama", "w1", "t1", "float32", 2048)


def inst(iid: str, role: str, fp: Fingerprint | None = FP, config: str = "abc", **extra: Any) -> dict[str, Any]:
    return {"instance_id": iid, "role": role, "fingerprint": fp.to_wire() if fp else {}, "config_hash": config,
            "healthy": True, **extra}


def test_a_consistent_deployment_passes() -> None:
    found = check([inst("d0", "decode"), inst("p0", "prefill"), inst("r0", "relay", None)],
                  {"router_config_hash": "abc", "router_format_version": FP.format_version})
    assert [f for f in found if f.level in (ERROR, WARN)] == []


def test_planted_mismatches_are_found() -> None:
    far = dataclasses.replace(FP, format_version=FP.format_version + 2)
    other = dataclasses.replace(FP, model="m2", weights="w2")
    found = check([inst("d0", "decode"), inst("p0", "prefill", far), inst("p1", "prefill", other, config="zzz"),
                   inst("d9", "decode", healthy=False)],
                  {"router_config_hash": "abc", "router_format_version": FP.format_version})
    text = "\n".join(f"{f.level} {f.message}" for f in found)
    assert f"error blob format versions {FP.format_version}" in text and "more than one apart" in text
    assert f"error pool {other.pool_key()} (m2) has no decode instance" in text
    assert "error d9 (decode) has missed its heartbeats" in text
    assert "warn config differs" in text and "zzz: p1" in text
    assert found[0].level == ERROR  # worst first


PROFILE = {"model": "m", "prefill": [{"seq_len": 128, "seconds": 0.05}, {"seq_len": 4096, "seconds": 2.0}],
           "decode": [{"batch": 1, "tpot_seconds": 0.02}, {"batch": 16, "tpot_seconds": 0.04}],
           "kv": [{"seq_len": 128, "codec": "none", "bytes": 2**20}, {"seq_len": 4096, "codec": "none",
                                                                     "bytes": 32 * 2**20}]}
SIGNALS = {"arrival_rps": 4.0, "prompt_lengths": {"128": 150, "4096": 90}, "mean_output_tokens": 100,
           "offload_fraction": 0.5, "instances": {"prefill": 1, "decode": 1}, "offload_threshold_tokens": 256,
           "prefill_queue_wait_s": 3.0, "decode_queue_depth": 20}


def test_recommend_on_synthetic_signals() -> None:
    advice = recommend(SIGNALS, SpeedProfile.from_json(PROFILE), link_bps=10e9)
    # long prompts (2 s each, 1.5/s) need ⌈3 / 0.7⌉ = 5 prefill instances; short ones stay on decode
    assert advice.offload_threshold_tokens == 128 and advice.prefill_instances == 5
    assert advice.decode_instances == 2 and 0.3 < advice.offload_fraction < 0.4
    assert any("prefill queues" in r for r in advice.reasons)
    slow = recommend(SIGNALS, SpeedProfile.from_json(PROFILE), link_bps=1e9)  # 1.5/s × 256 Mbit does not fit
    assert slow.link_utilisation > 0.3


def test_recommend_command_reads_saved_signals(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    (tmp_path / "s.json").write_text(json.dumps(SIGNALS))
    result = CliRunner().invoke(app, ["admin", "recommend", "--profile", str(tmp_path / "p.json"), "--signals",
                                      str(tmp_path / "s.json"), "--link", "10gbit", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["prefill_instances"] == 5
