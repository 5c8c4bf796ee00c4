"""The acceptance recipe, run as written: its code block is read from docs/acceptance.md and run by bash from the
repository root, scaled down (tiny-llama for SmolLM2, 3 s cells at concurrency 1, 512-token prompts, free ports
for 8000/8001, the report in a temporary directory). Every substitution must apply, so a recipe edited out of
shape fails here. Checks that both deployments and the lab came up and went away, and that the bench ran every
cell through the lab against the baseline the recipe starts. Root and namespaces needed; skipped when a lab is
already up (the recipe's `lab up` would take it over)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prfaas.lab import Topology, missing_support
from prfaas.lab.system import namespaces
from tests.services.deploy import free_port

ROOT = Path(__file__).resolve().parents[2]
SCALE = " --duration 3s --concurrency 1 --input-len 512 --output-len 4 --quiet"


def recipe() -> str:
    """The first code block of docs/acceptance.md's recipe section."""
    section = (ROOT / "docs" / "acceptance.md").read_text().split("\n## The recipe\n", 1)[1]
    match = re.search(r"```\n(.*?)```", section, re.S)
    assert match, "the recipe section has no code block"
    return match.group(1)


def scaled(text: str, ports: tuple[int, int], out: Path) -> str:
    swaps = [(":8000", f":{ports[0]}"), ("--port 8000", f"--port {ports[0]}"), (":8001", f":{ports[1]}"),
             ("--port 8001", f"--port {ports[1]}"), ("smollm2-135m", "tiny-llama"), ("--out report/", f"--out {out}")]
    for old, new in swaps:
        assert old in text, f"the recipe no longer has {old!r}"
        text = text.replace(old, new)
    bench = next(line for line in text.splitlines() if line.startswith("prfaas bench run"))
    return text.replace(bench, bench + SCALE)


def _left(ports: tuple[int, int]) -> list[str]:
    """Command lines of processes still serving the recipe's ports."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "prfaas" in cmd and any(f"--port {p}" in cmd for p in ports):
            found.append(cmd)
    return found


@pytest.mark.slow
def test_the_readme_acceptance_recipe_runs_as_written(tmp_path: Path) -> None:
    if missing_support() is not None:
        pytest.skip(f"lab unavailable here: {missing_support()}")
    if Topology().ns_a in namespaces():
        pytest.skip("a lab is already up (dc-a exists): the recipe's `prfaas lab up` would take it over")
    ports, out = (free_port(), free_port()), tmp_path / "report"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "prfaas").write_text(f"#!/bin/sh\nexec {sys.executable} -m prfaas \"$@\"\n")
    (bin_dir / "prfaas").chmod(0o755)
    script = tmp_path / "recipe.sh"
    # A failure inside the recipe still stops both deployments and the lab (the recipe's own last line does
    # that when it runs to the end).
    script.write_text("trap 'exit 143' TERM INT\ntrap 'kill $(jobs -p) 2>/dev/null; wait; prfaas lab down' EXIT\n"
                      + scaled(recipe(), ports, out))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    with subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=560)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=120)
            pytest.fail(f"the recipe ran past 560 s; its end:\n{stderr[-3000:]}")
    assert Topology().ns_a not in namespaces(), "the lab was left up"
    assert not _left(ports), f"processes left behind: {_left(ports)}"
    assert "acceptance: " in stdout, stdout[-2000:] + stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["network_control"] == "lab" and results["meta"]["baseline"].endswith(f":{ports[1]}")
    assert results["verdict"] in ("PASS", "FAIL")  # judged: no cell was skipped
    assert {c["network"] for c in results["cells"]} == {"normal", "delay", "loss", "cut"}
    assert all(not c.get("skipped") and c["metrics"]["ok"] >= 1 for c in results["cells"]), results["cells"]
    assert [c["load_key"] for c in results["baseline_cells"]] == ["in512-out4-c1"]
    assert all(c["metrics"]["ok"] >= 1 for c in results["baseline_cells"])
