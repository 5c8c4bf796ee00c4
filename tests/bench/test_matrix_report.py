"""Matrix files and the written report (JSON, Markdown, HTML, plot)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prfaas.bench.matrix import from_dict, load_matrix
from prfaas.bench.report import write
from prfaas.bench.verdict import overall, verdict_line
from prfaas.errors import InvalidRequest


def test_profiles_load_and_mirror_the_documents() -> None:
    full = load_matrix(None, "acceptance")
    assert full.input_lens == (1024, 8192, 32768) and full.output_lens == (64, 256, 512)
    assert full.concurrency == (1, 8, 32, 64) and full.networks == ("normal", "delay", "loss", "cut")
    assert len(full.cells()) == 3 * 3 * 4 * 4
    quick = load_matrix(None, "quick")
    assert quick.duration_s == 5 and quick.cells()[0].network == "normal"


def test_bad_matrices_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        from_dict({"networks": ["flood"]})
    with pytest.raises(InvalidRequest):
        from_dict({"bogus": 1})
    with pytest.raises(InvalidRequest):
        from_dict({"concurrency": [0]})
    assert from_dict({"requests": 5}).duration_s is None


def test_report_is_written_with_table_verdicts_and_plot(tmp_path: Path) -> None:
    metrics = {"requests": 2, "ok": 2, "success_rate": 1.0, "errors": {},
               "ttft_ms": {"p50": 10.0, "p90": 11.0, "p99": 12.0, "mean": 10.5},
               "tpot_ms": {"p50": 5.0, "p90": 5.0, "p99": 5.0, "mean": 5.0},
               "itl_ms": {"p50": 5.0, "p90": 5.0, "p99": 6.0, "mean": 5.0},
               "e2e_ms": {"p50": 30.0, "p90": 31.0, "p99": 32.0, "mean": 30.0},
               "output_tokens_per_s": 100.0, "goodput_rps": 0.5,
               "transfer": {"success_rate": 1.0, "retry_rate": 0.0, "degrade_rate": 0.5,
                            "transfer_ms": {"p50": 3.0, "p99": 4.0}},
               "kv": {"available": True, "on_time": True}}
    failing = {"pass": False, "failed": ["degrade_rate"],
               "checks": [{"name": "degrade_rate", "value": 0.5, "limit": 0.01, "pass": False}]}
    records = [{"start": 0.0, "ttft_s": 0.01, "e2e_s": 0.03}, {"start": 0.5, "ttft_s": 0.012, "e2e_s": 0.031}]
    results = {"meta": {"target": "http://x", "started": "now", "matrix_source": "quick", "network_control": "lab",
                        "baseline": None},
               "matrix": {"acceptance": {"ttft_overhead": 0.5}}, "baseline_cells": [],
               "cells": [{"key": "in8-out4-c1-cut", "metrics": metrics, "verdict": failing, "records": records,
                          "fault_window": [0.2, 0.4], "span": [0.0, 1.0]},
                         {"key": "in8-out4-c1-loss", "network": "loss", "skipped": "no lab"}],
               "samples": [{"t": 1.0, "cpu_percent": 50.0, "mem_used_mb": 100, "wan_gbps": 0.1}]}
    results.update(overall(results["cells"]))
    write(tmp_path, results)
    md = (tmp_path / "report.md").read_text()
    assert "| in8-out4-c1-cut |" in md and "FAIL: degrade_rate" in md and "skipped: no lab" in md
    assert "degrade_rate = 0.5 (limit 0.01)" in md
    assert json.loads((tmp_path / "results.json").read_text())["pass"] is False
    assert "<pre>" in (tmp_path / "report.html").read_text()
    plotted = json.loads((tmp_path / "results.json").read_text()).get("plot")
    assert plotted is None or (tmp_path / "report.png").stat().st_size > 1000


def test_a_run_with_skipped_cells_is_not_judged_and_says_why() -> None:
    passed = {"key": "in8-out4-c1-normal", "verdict": {"pass": True}}
    skipped = [{"key": f"in8-out4-c1-{n}", "skipped": "no lab: lab not up"} for n in ("delay", "loss", "cut")]
    results = overall([passed, *skipped])
    assert results["pass"] is False and results["verdict"] == "NOT JUDGED"
    assert verdict_line(results) == "not judged: 3 of 4 cells skipped (3 × no lab: lab not up)"
    assert overall([passed])["verdict"] == "PASS" and verdict_line(overall([passed])) == "PASS"
    failing = overall([{"key": "x", "verdict": {"pass": False}}, *skipped[:1]])
    assert failing["verdict"] == "FAIL" and verdict_line(failing).startswith("FAIL; 1 of 2 cells skipped")
    assert overall([])["verdict"] == "NOT JUDGED" and verdict_line(overall([])) == "not judged: no cell ran"
