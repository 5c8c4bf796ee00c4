"""``prfaas bench run`` against a real tiny deployment (real processes, real sockets), few requests per cell."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prfaas.lab.spec import Topology
from prfaas.lab.system import namespaces
from tests.services.deploy import deployment

MODEL = "tiny-llama"


def test_bench_run_against_a_tiny_deployment_writes_a_full_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    no_lab = Topology().ns_a not in namespaces()  # never change a lab someone has up
    network = "normal,loss" if no_lab else "normal"
    with deployment(MODEL, "relay", threshold=16) as (url, _):
        cmd = [sys.executable, "-m", "prfaas", "bench", "run", "--target", url, "--baseline", url,
               "--requests", "3", "--input-len", "40", "--output-len", "4", "--concurrency", "1,2",
               "--network", network, "--out", str(out), "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-2000:]  # 1: a cell failed acceptance (reported, not a crash)
    results = json.loads((out / "results.json").read_text())
    judged = [c for c in results["cells"] if not c.get("skipped")]
    assert [c["key"] for c in judged] == ["in40-out4-c1-normal", "in40-out4-c2-normal"]
    if no_lab:
        assert [c["network"] for c in results["cells"] if c.get("skipped")] == ["loss", "loss"]
    assert len(results["baseline_cells"]) == 2
    [warm] = results["meta"]["warm_up"].values()  # target and baseline are one URL here: warmed once
    assert warm["error"] is None and warm["output_tokens"] == 4  # and counted in no cell (3 requests each, below)
    for cell in judged:
        m = cell["metrics"]
        assert m["requests"] == 3 and m["ok"] == 3, m["errors"]
        assert m["transfer"]["prfaas_responses"] == 3
        assert all(r["output_tokens"] >= 1 and r["ttft_s"] is not None for r in cell["records"])
        assert m["kv"]["available"] and m["kv"]["live_after"] == 0
        assert m["router"]["prfaas_router_requests_total"] == 3  # the router's own count, from /metrics
        assert set(m["resources"]) >= {"cpu_percent_mean", "wan_gbps_mean"}
        assert {c["name"] for c in cell["verdict"]["checks"]} >= {"ttft_p50_ms", "ttft_p99_ms", "success_rate"}
    assert (out / "report.md").exists() and (out / "report.html").exists()
    assert ("acceptance: PASS" in done.stdout) == (done.returncode == 0)
    if no_lab:  # skipped cells: never a PASS, and the verdict says how many and why
        assert results["verdict"] != "PASS" and done.returncode == 1
        assert "cells skipped (2 × no lab" in done.stdout, done.stdout[-500:]
