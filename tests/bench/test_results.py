"""docs/benchmarks.md is generated from benchmarks/results/ and must equal what regenerating it gives; the page
says where each figure came from as the JSON records it, and "not recorded" where it does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prfaas.bench.provenance import cpu, provenance
from prfaas.bench.results import NOT_RECORDED, render

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_what_make_results_writes() -> None:
    done = subprocess.run([sys.executable, "scripts/results.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_results_file_has_a_section() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    results = ROOT / "benchmarks" / "results"
    for path in results.rglob("*.json"):
        assert f"\n## {path.relative_to(results)}" in page


def test_provenance_is_shown_as_recorded_and_never_guessed(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text(json.dumps({"rows": [{"a": 1, "b": 2.5}]}))
    (tmp_path / "new.json").write_text(json.dumps({"provenance": provenance(["bench.py", "--fast"]),
                                                   "rows": [{"a": 3}]}))
    page = render(tmp_path)
    old, new = (page.split(f"## {name}\n")[1].split("\n## ")[0] for name in ("old.json", "new.json"))
    assert old.count(NOT_RECORDED) == 5  # written by, command, date, CPU, instruction set
    facts = new.split("### ")[0]
    assert "- command: bench.py --fast\n" in facts and facts.count(NOT_RECORDED) == 1  # only "written by"
    assert "| 1 | 2.50 |" in old and "| 3 |" in new


def test_cpu_model_and_isa_come_from_cpuinfo() -> None:
    info = "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse2 avx2 avx512f amx_tile\n"
    assert cpu(info) | {"cores": 0} == {"cpu_model": "Example CPU 9000", "isa": ["avx2", "avx512f", "amx_tile"],
                                        "cores": 0}
