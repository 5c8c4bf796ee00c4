"""The plan commands end to end through the prfaas CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from prfaas.cli import app

ROOT = Path(__file__).parents[2]
FIX = Path(__file__).parent / "fixtures"
TABLE5 = ROOT / "docs" / "examples" / "paper-table5-profile.json"


def run_json(*args: str) -> dict[str, Any]:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert isinstance(out, dict)
    return out


def test_plan_kv_json_and_comma_lengths() -> None:
    out = run_json("plan", "kv", "--config", str(FIX / "llama-3.1-8b-instruct.json"), "--seq-len", "1024,8192",
                   "--seq-len", "4k", "--json")
    assert [r["seq_len"] for r in out["per_length"]] == [1024, 8192, 4096]
    assert out["per_length"][1]["kv_bytes"] == 2**30
    assert out["bytes_per_token"] == 131072 and out["fixed_bytes"] == 0 and len(out["layers"]) == 32


def test_plan_kv_model_dir_and_table(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((FIX / "qwen3-next-80b-a3b-instruct.json").read_text())
    res = CliRunner().invoke(app, ["plan", "kv", "--model", str(tmp_path), "--seq-len", "8192"])
    assert res.exit_code == 0, res.output
    assert "gated_deltanet" in res.output and "8,192" in res.output


def test_table5_phi_kv_matches_the_paper() -> None:
    """Paper Table 5: Φ_kv 3.61 / 3.59 / 3.19 / 2.62 Gbps (MiB = 2^20 B, Gbps = 10^9 bit/s; 1 % for rounding)."""
    out = run_json("plan", "capacity", "--profile", str(TABLE5), "--bandwidth", "100gbit", "--json")
    phi = {r["seq_len"]: r["phi_kv_gbps"] for r in out["phi_kv"]}
    for n, paper in {1024: 3.61, 8192: 3.59, 32768: 3.19, 131072: 2.62}.items():
        assert phi[n] == pytest.approx(paper, rel=0.01)
    assert [round(r["kv_mib"], 1) for r in out["phi_kv"]] == [190.8, 308.9, 701.3, 2316.3]


def test_capacity_chooses_threshold_and_split() -> None:
    out = run_json("plan", "capacity", "--profile", str(TABLE5), "--bandwidth", "100gbit", "--prfaas", "4",
                   "--local", "8", "--lengths", "lognormal:median=8192,sigma=1.5,max=131072,bins=32",
                   "--decode-batch", "64", "--tpot-ms", "30", "--output-len", "512", "--json")
    best = out["best"]
    assert best["local_prefill"] + best["decode"] == 8
    assert best["lambda_max"] == max(p["lambda_max"] for p in out["thresholds"])
    assert best["lambda_max"] > 0 and best["bound"] in ("prfaas_compute", "prfaas_link", "local_prefill",
                                                        "decode")


def test_capacity_link_bound_when_link_is_thin() -> None:
    out = run_json("plan", "capacity", "--profile", str(TABLE5), "--bandwidth", "1gbit", "--prfaas", "8",
                   "--local", "2", "--json")
    remote = next(p for p in out["thresholds"] if p["p"] == 1.0)
    assert remote["bound"] == "prfaas_link"


def test_link_verdict_reasons_and_largest_length() -> None:
    out = run_json("plan", "link", "--config", str(FIX / "llama-3.1-8b-instruct.json"), "--bandwidth", "10gbit",
                   "--rtt-ms", "5", "--rtt-p99-ms", "8", "--loss-pct", "0.01", "--qps", "2",
                   "--mix", "hist:1024=0.5,8192=0.4,32768=0.1", "--ttft-budget-ms", "2000",
                   "--e2e-budget-ms", "20000", "--json")
    rules = {c["rule"]: c for c in out["checks"]}
    assert set(rules) == {"bandwidth", "rtt", "loss", "transfer_p99"}
    # mean KV = (0.5·1024 + 0.4·8192 + 0.1·32768) × 128 KiB; × 2 QPS × 8 bit
    demand = (0.5 * 1024 + 0.4 * 8192 + 0.1 * 32768) * 131072 * 2 * 8 / 1e9
    assert rules["bandwidth"]["value"] == pytest.approx(demand)
    assert rules["bandwidth"]["limit"] == pytest.approx(7.0)
    assert rules["rtt"]["ok"] and rules["loss"]["ok"]
    assert out["largest_prompt_tokens"] > 0
    assert {"chunk_size_kb", "kv_transfer_timeout_ms", "kv_retry_budget", "max_inflight_kv"} <= set(
        out["recommended"])
    assert 1024 <= out["recommended"]["chunk_size_kb"] <= 8192


def test_link_failure_says_why() -> None:
    out = run_json("plan", "link", "--config", str(FIX / "llama-3.1-8b-instruct.json"), "--bandwidth", "1gbit",
                   "--rtt-ms", "40", "--loss-pct", "1", "--qps", "10", "--seq-len", "32768",
                   "--ttft-budget-ms", "100", "--json")
    assert out["verdict"] == "not feasible"
    assert set(out["failed"]) == {"bandwidth", "rtt", "loss", "transfer_p99"}
    assert any(a.startswith("bandwidth:") for a in out["advice"])
    assert out["largest_prompt_tokens"] < 32768
    transfer = next(c for c in out["checks"] if c["rule"] == "transfer_p99")
    assert transfer["value"] is None  # the link is saturated: no finite transfer time, and valid JSON


def test_link_reads_kv_file(tmp_path: Path) -> None:
    kv = run_json("plan", "kv", "--config", str(FIX / "deepseek-v3.json"), "--json")
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(kv))
    out = run_json("plan", "link", "--kv", str(path), "--bandwidth", "100gbit", "--rtt-ms", "1", "--qps", "1",
                   "--seq-len", "8192", "--ttft-budget-ms", "1000", "--json")
    assert out["checks"][0]["value"] == pytest.approx(61 * 576 * 2 * 8192 * 8 / 1e9)


def test_errors_exit_2_with_a_clean_message() -> None:
    code = "from prfaas.cli import main; main()"
    res = subprocess.run([sys.executable, "-c", code, "plan", "kv", "--config", str(FIX / "nope.json")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 2
    assert "INVALID_REQUEST" in res.stderr and "Traceback" not in res.stderr
