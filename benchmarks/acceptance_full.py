"""The full acceptance run against our own deployment, model after model (``benchmarks/acceptance-full.yaml``):
the lab (1 Gbit WAN), then per model ``prfaas up --lab`` plus a monolithic baseline deployment on 127.0.0.1, and
``prfaas bench run`` with every network condition. Needs root. Writes, under ``--out``:

- ``<model>/`` (or the entry's ``label``): the bench's ``results.json``, ``report.md``, ``report.html``,
  ``report.png``, and the matrix and deployment config it ran with;
- ``soak-<model>/``: the same for the soak (``soak:`` in the config), one long cell per network condition, run
  last against that model's deployment;
- ``summary.json``: per model the verdict, wall time and load average (1-minute, sampled every 10 s);
- ``report.md``: every model's table, the failures with their measured values, and the load average.

    .venv/bin/python benchmarks/acceptance_full.py [--out docs/reports/acceptance-full] [--only MODEL ...]

Everything it starts (lab, deployments) is stopped on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from prfaas.bench.provenance import provenance
from prfaas.lab import Lab, LinkSettings
from prfaas.services.up import Deployment, UpOptions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class LoadSampler:
    """The 1-minute load average every ``interval_s`` in a daemon thread, until ``stop``."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s, self._stop = interval_s, threading.Event()
        self.samples: list[tuple[float, float]] = []
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((round(time.monotonic() - self._started, 1), round(os.getloadavg()[0], 2)))
            self._stop.wait(self.interval_s)

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> dict[str, float | None]:
        values = [v for t, v in self.samples if start <= t <= end]
        if not values:
            return {"min": None, "mean": None, "max": None}
        return {"min": min(values), "mean": round(sum(values) / len(values), 2), "max": max(values)}


def matrix_for(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    return {"input_lens": spec["input_lens"], "output_lens": spec["output_lens"],
            "concurrency": spec["concurrency"], "networks": ["normal", "delay", "loss", "cut"],
            "duration_s": spec.get("cell_s", run["cell_s"]), "request_timeout_s": spec["request_timeout_s"],
            "network": {**run["network"], **spec.get("network", {})}, "acceptance": run["acceptance"]}


def soak_spec(run: dict[str, Any]) -> dict[str, Any] | None:
    """The soak as one more model entry: the soak model's entry with one cell per condition of ``duration_s``
    (the cut repeating every ``cut_every_s``), judged against that entry's monolithic baseline of the same cell
    (its ``results.json``: the soak cell must be one of the entry's cells)."""
    soak = run.get("soak")
    if not soak:
        return None
    base = next(m for m in run["models"] if m.get("label", m["model"]) == soak["entry"])
    return {**base, "label": f"soak-{soak['entry']}", "input_lens": [soak["input_len"]],
            "output_lens": [soak["output_len"]], "concurrency": [soak["concurrency"]], "cell_s": soak["duration_s"],
            "network": {"cut_every_s": soak["cut_every_s"]}, "baseline_of": soak["entry"]}


def run_model(spec: dict[str, Any], run: dict[str, Any], out: Path, port: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.yaml").write_text(yaml.safe_dump(matrix_for(spec, run), sort_keys=False))
    (out / "deploy-config.yaml").write_text(yaml.safe_dump(spec["config"], sort_keys=False))
    common = {"model": spec["model"], "dtype": spec["dtype"], "config": str(out / "deploy-config.yaml"),
              "log_file": str(out.parent / f"{out.name}.log")}
    earlier = out.parent / spec["baseline_of"] / "results.json" if spec.get("baseline_of") else None
    baseline = None if earlier else Deployment(UpOptions(port=port + 1, offload_threshold=1_000_000, **common))
    remote = Deployment(UpOptions(port=port, offload_threshold=spec["offload_threshold"], lab=True, **common))
    deployments = [d for d in (baseline, remote) if d is not None]
    try:
        for deployment in deployments:
            deployment.start()
        for deployment in deployments:
            deployment.wait_ready()
        reference = str(earlier) if earlier else baseline.url if baseline else ""
        cmd = [sys.executable, "-m", "prfaas", "bench", "run", "--matrix", str(out / "matrix.yaml"),
               "--target", remote.url, "--baseline", reference, "--out", str(out), "--quiet"]
        done = subprocess.run(cmd, timeout=4 * 3600, capture_output=True, text=True)
        (out / "bench.log").write_text(done.stdout + done.stderr)
        return {"exit": done.returncode}
    finally:
        for deployment in reversed(deployments):
            deployment.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(HERE / "acceptance-full.yaml"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "reports" / "acceptance-full"))
    parser.add_argument("--only", nargs="*", default=None, help="model names to run (default: all)")
    args = parser.parse_args()
    run = yaml.safe_load(Path(args.config).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loads = LoadSampler().start()
    summary: dict[str, Any] = {"started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                               "commit": _commit(), "cpus": os.cpu_count(), "config": run, "models": []}
    began = time.monotonic()
    try:
        with Lab(LinkSettings(rate=run["link_rate"])):
            soak = soak_spec(run)
            for i, spec in enumerate([*run["models"], *([soak] if soak else [])]):
                name = spec.get("label", spec["model"])
                if args.only and name not in args.only:
                    continue
                start = time.monotonic() - began
                print(f"== {name}", file=sys.stderr, flush=True)
                result = run_model(spec, run, out / name, 8320 + 10 * i)
                end = time.monotonic() - began
                summary["models"].append({"model": name, "served_model": spec["model"],
                                          "wall_s": round(end - start, 1), "loadavg_1m": loads.between(start, end),
                                          **result})
                print(f"   exit {result['exit']}, {end - start:.0f} s", file=sys.stderr, flush=True)
    finally:
        loads.stop()
        summary["provenance"] = provenance()
        summary["wall_s"] = round(time.monotonic() - began, 1)
        summary["loadavg_1m"] = loads.between(0, float("inf"))
        summary["loadavg_samples"] = loads.samples
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    subprocess.run([sys.executable, str(HERE / "acceptance_summary.py"), str(out)], check=False)
    return 0 if all(m["exit"] == 0 for m in summary["models"]) else 1


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
