"""CI's quick acceptance profile: the real embedded model (SmolLM2-135M), ``prfaas up --lab`` in the lab's two
datacenters, a monolithic baseline, and ``prfaas bench run --quick`` with every network condition
(``benchmarks/acceptance_quick.py``). Checks the report's structure, that the faults were really applied through
the lab, and that acceptance passes in normal conditions at concurrency 1. About two minutes in bfloat16, four in
float32 on an AVX2-only CPU (``--dtype auto`` picks); root and namespaces needed.

At concurrency 4 the verdict is reported, not required: on one 2-core host the disaggregated deployment's prefill
and decode processes share the cores the monolithic baseline has to itself, and in a quiet CI-like run its TTFT
P50 was 5.9 s against 3.0 s monolithic (limit 1.5x). That is a finding of the acceptance run (docs/acceptance.md),
not a property this test can hold on such a machine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prfaas.lab import Topology, missing_support
from prfaas.lab.system import namespaces

ROOT = Path(__file__).resolve().parents[2]
REASON = missing_support()


def _skip_reason() -> str | None:
    if REASON is not None:
        return f"lab unavailable here: {REASON}"
    if Topology().ns_a in namespaces():  # the quick run needs the default lab, and never changes one in use
        return "a lab is already up (dc-a exists): the quick profile would have to take it over"
    return None


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``cmd``'s result; past ``timeout`` it gets Ctrl-C (the script then stops both deployments and the lab, which a
    kill would leave up for every later run) and the test fails."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=120)
            pytest.fail(f"the quick profile ran past {timeout:.0f} s; its end:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_quick_profile_through_the_lab_serves_every_cell_and_reports_its_verdict(tmp_path: Path) -> None:
    """The whole quick profile through the lab: every cell runs, the report holds every check. In normal
    conditions at concurrency 1 nothing may fail that is not a timing: every request and every transfer succeeds,
    none retried or degraded, every blob released on time. The TTFT checks (against the monolithic baseline of the
    same run) are reported, not required: they rank this machine's cores against the lab's link."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "quick"
    done = _run([sys.executable, str(ROOT / "benchmarks" / "acceptance_quick.py"), "--out", str(out),
                 "--port", "8390", "--", "--quiet"], timeout=560)
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: some fault cell failed acceptance (reported)
    assert Topology().ns_a not in namespaces(), "the lab was left up"
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["network_control"] == "lab" and results["meta"]["model"] == "smollm2-135m"
    cells = {c["key"]: c for c in results["cells"]}
    assert set(cells) == {f"in1024-out32-c{c}-{n}" for c in (1, 4) for n in ("normal", "delay", "loss", "cut")}
    assert {c["load_key"] for c in results["baseline_cells"]} == {"in1024-out32-c1", "in1024-out32-c4"}
    for cell in cells.values():
        assert not cell.get("skipped"), cell
        m = cell["metrics"]
        assert m["requests"] >= 1 and set(m["ttft_ms"]) >= {"p50", "p90", "p99"}
        assert {"success_rate", "retry_rate", "degrade_rate", "transfer_ms"} <= set(m["transfer"])
        assert m["kv"]["available"] and set(m["resources"]) >= {"cpu_percent_mean", "wan_gbps_mean"}
        assert {c["name"] for c in cell["verdict"]["checks"]} >= {"ttft_p50_ms", "ttft_p99_ms", "success_rate",
                                                                "transfer_success", "retry_rate", "degrade_rate"}
        assert cell["link"]["rate"] == "1gbit"
    assert cells["in1024-out32-c1-delay"]["link"]["delay_ms"] == 10
    assert cells["in1024-out32-c1-loss"]["link"]["loss"] == 0.01
    assert all(cells[f"in1024-out32-c{c}-cut"]["fault_window"] for c in (1, 4))
    text = (out / "report.md").read_text()
    assert "| cell | n | ok % | TTFT P50" in text and "## Why cells failed" in text
    assert (out / "report.html").exists() and (out / "report.png").stat().st_size > 0
    checks = {c["name"]: c for c in cells["in1024-out32-c1-normal"]["verdict"]["checks"]}
    functional = [c for name, c in checks.items() if not name.startswith("ttft_")]
    assert {c["name"] for c in functional} >= {"success_rate", "transfer_success", "retry_rate", "degrade_rate",
                                               "kv_released_on_time"}
    assert all(c["pass"] for c in functional), f"normal c1: {functional} (stdout: {done.stdout[-2000:]})"
    for key in ("in1024-out32-c1-normal", "in1024-out32-c4-normal"):
        got = {c["name"]: (c["value"], c["limit"], c["pass"]) for c in cells[key]["verdict"]["checks"]}
        print(f"\nquick profile, {key} (TTFT reported, not required): {got}")
