"""A rolling upgrade under load: figures for the scenario of ``tests/services/test_upgrade.py``.

    .venv/bin/python benchmarks/upgrade.py [--clients 2] [--hold 3] [--steps 10,50,100]
                                           [--out benchmarks/results/upgrade.json]

A ``prfaas up`` deployment (relay mode) serves tiny-llama (fingerprint X) while ``--clients`` threads send greedy
completions through the router's OpenAI API; new prefill and decode instances of tiny-llama with other weights
(fingerprint Y, same model name) are started and registered, then ``prfaas admin rollout`` moves the traffic in
``--steps`` (each held ``--hold`` seconds) and drains the old instances one by one. Recorded: requests during the
upgrade (from starting the new instances to the last old instance gone), failures, fallbacks, mixed pairs, greedy
texts that differ from the monolithic run of the model that served them, the upgrade and rollout durations, each
drain's duration, and end-to-end latency before, during and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.audit import verify
from prfaas.audit.chain import read_entries
from prfaas.bench.provenance import provenance
from tests.services.test_upgrade import Served, UpgradeRun, greedy_check, mixed_pairs, run_upgrade


def _latency_ms(results: list[Served]) -> dict[str, float | None]:
    times = sorted((r.ended - r.started) * 1e3 for r in results)
    if not times:
        return {"p50": None, "p99": None}
    return {"p50": round(statistics.median(times), 1), "p99": round(times[min(len(times) - 1,
                                                                              int(0.99 * len(times)))], 1)}


def accesses(path: Path) -> dict[str, int]:
    """The relay's store accesses by ``action:outcome``."""
    return dict(Counter(f"{e['action']}:{e['outcome']}" for _, e, _ in read_entries(path)
                        if e and e.get("kind") == "access"))


def per_step(run: UpgradeRun) -> list[dict[str, Any]]:
    """Requests started during each canary step (until the next step or the first drain), by the pool that
    served them."""
    marks = [(run.rollout_began + e["at_s"], e) for e in run.rollout["events"] if e["action"] in ("weight", "drained")]
    out = []
    for (start, event), (end, _) in itertools.pairwise(marks):
        if event["action"] != "weight":
            continue
        served = Counter("new" if r.extension.get("pool") == run.new_pool else "old"
                         for r in run.results if start <= r.started < end)
        out.append({"new_weight": event["new"], "seconds": round(end - start, 2), **served})
    return out


def summarise(run: UpgradeRun, clients: int, hold_s: float, steps: str) -> dict[str, Any]:
    start, end = run.upgrade_window
    before = [r for r in run.results if r.ended < start]
    during = [r for r in run.results if r.ended >= start and r.started <= end]
    after = [r for r in run.results if r.started > end]
    ok = [r for r in run.results if r.status == 200]
    wrong, near_ties = greedy_check(run)
    audit = verify(run.audit)
    return {
        "scenario": {"model": "tiny-llama", "mode": "relay", "clients": clients, "hold_s": hold_s, "steps": steps},
        "requests": len(run.results), "requests_during_upgrade": len(during),
        "failed": len(run.results) - len(ok),
        "fallbacks": sum(1 for r in ok if r.extension.get("fallback")),
        "retries": sum(int(r.extension.get("retries", 0)) for r in ok),
        "mixed_pairs": len(mixed_pairs(run)),
        "greedy_mismatches": len(wrong), "near_ties": near_ties,
        "served_by_pool": {("old" if k == run.old_pool else "new"): v
                           for k, v in Counter(r.extension["pool"] for r in ok).items()},
        "remote_requests": sum(1 for r in ok if r.extension.get("route") == "remote"),
        "upgrade_s": round(end - start, 2), "rollout_s": run.rollout["duration_s"],
        "drains_s": {e["instance"]: e["seconds"] for e in run.rollout["events"] if e["action"] == "drained"},
        "latency_ms": {"before": _latency_ms(before), "during": _latency_ms(during), "after": _latency_ms(after)},
        "audit": {"ok": audit.ok, "created": audit.created, "ended": dict(audit.ended),
                  "open_blobs": len(audit.open_blobs), "accesses": accesses(run.audit)},
        "canary_steps": per_step(run),
        "rollout_events": run.rollout["events"],
    }


def show(result: dict[str, Any]) -> None:
    table = Table(title="Rolling upgrade under load (tiny-llama X → Y, relay mode)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in ("requests_during_upgrade", "failed", "fallbacks", "retries", "mixed_pairs", "greedy_mismatches",
                "near_ties", "upgrade_s", "rollout_s"):
        table.add_row(key, str(result[key]))
    table.add_row("served_by_pool", json.dumps(result["served_by_pool"]))
    table.add_row("drains_s", json.dumps(result["drains_s"]))
    for step in result["canary_steps"]:
        table.add_row(f"step new={step['new_weight']:g} ({step['seconds']} s)",
                      f"old {step.get('old', 0)} / new {step.get('new', 0)}")
    for phase, lat in result["latency_ms"].items():
        table.add_row(f"e2e {phase} (p50 / p99 ms)", f"{lat['p50']} / {lat['p99']}")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--hold", type=float, default=3.0, help="seconds each canary step is held")
    parser.add_argument("--steps", default="10,50,100")
    parser.add_argument("--out", default="benchmarks/results/upgrade.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prfaas-upgrade-") as tmp:
        run = run_upgrade(Path(tmp), clients=args.clients, hold_s=args.hold, steps=args.steps,
                          before_s=args.hold, after_s=args.hold)
        result = summarise(run, args.clients, args.hold, args.steps)
    result["provenance"] = provenance()
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]  # 2 cores shared with other work
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    show(result)


if __name__ == "__main__":
    main()
