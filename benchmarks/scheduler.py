"""Offload policies compared on a simulated cluster: the online cost model (``offload_policy: cost``) against the
best fixed threshold found by a sweep, all-remote and all-local; on a steady link and on one whose bandwidth halves
mid-run. No model runs: instances are emulated with measured speeds (a ``prfaas measure``-style speed profile;
default: the PrfaaS paper's Table 5 hybrid); the simulation is ``prfaas.plan.simulate`` (its docstring states the
model, and the JSON repeats it).

    .venv/bin/python benchmarks/scheduler.py [--profile docs/examples/paper-table5-profile.json]
        [--prefill 4 --decode 8 --local-slowdown 3 --bandwidths-gbps 100,20,10 --requests 3000 --loads 0.8,1.3]
        [--out benchmarks/results/scheduler.json]

Load is relative to the all-remote capacity on the steady link. Policies per cell: all-local, all-remote, every
threshold of the sweep, ``fixed (tuned)`` — the sweep's best on the *steady* link at that load, i.e. the threshold
a deployment would have planned, kept when the bandwidth halves — and ``online`` (``link_share`` 0.7, the default)
and ``online, share 1.0`` (the same link allowance as the fixed thresholds, which have no utilisation limit).
Each policy's ``link_load`` is the KV rate it routed after the change over the link's bandwidth then; ``best fixed
within 70 %`` is the sweep's best among the thresholds whose load keeps the 70 % rule the online policy keeps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.provenance import provenance
from prfaas.plan import simulate
from prfaas.plan.profile import SpeedProfile, interpolate
from prfaas.plan.simulate import Sim, fixed, online, paper_workload, run

SWEEP = (0, 2048, 4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304)


def cell(base: Sim, rate: float, prompts: list[int], gaps: list[float], halved: bool,
         tuned: float | None) -> list[dict[str, Any]]:
    sim = replace(base, change_at_s=len(prompts) / rate / 2, change_factor=0.5) if halved else base
    policies: dict[str, tuple[float | None, simulate.Policy]] = {
        "all-local": (None, fixed(math.inf)), "all-remote": (0, fixed(0))}
    policies.update({f"fixed t={t // 1024}K": (t, fixed(t)) for t in SWEEP if t})
    if tuned is not None:
        policies["fixed (tuned)"] = (tuned, fixed(tuned))
    policies["online"] = (None, online())
    share_one = replace(sim, link_share=1.0)
    rows = [{"policy": name, "threshold": t, **run(sim, policy, rate, prompts, gaps)}
            for name, (t, policy) in policies.items()]
    rows.append({"policy": "online, share 1.0", "threshold": None, **run(share_one, online(), rate, prompts, gaps)})
    return rows


def summary(rows: list[dict[str, Any]], share: float) -> dict[str, Any]:
    by = {r["policy"]: r for r in rows}
    sweep = [r for r in rows if r["policy"].startswith("fixed t=") or r["policy"] == "all-remote"]
    best = max(sweep, key=lambda r: r["throughput_rps"])
    within = max([r for r in sweep if r["link_load"] <= share] or sweep, key=lambda r: r["throughput_rps"])
    online_rps = by["online"]["throughput_rps"]
    out = {"best_fixed": best["policy"], "best_fixed_rps": best["throughput_rps"],
           "best_fixed_link_load": best["link_load"], "online_rps": online_rps,
           "online_link_load": by["online"]["link_load"],
           "online_vs_best_fixed": online_rps / best["throughput_rps"],
           "online_share1_vs_best_fixed": by["online, share 1.0"]["throughput_rps"] / best["throughput_rps"],
           "best_fixed_within_share": within["policy"],
           "online_vs_best_fixed_within_share": online_rps / within["throughput_rps"]}
    if "fixed (tuned)" in by:
        tuned = by["fixed (tuned)"]
        out["online_vs_tuned_fixed"] = online_rps / tuned["throughput_rps"]
        out["online_share1_vs_tuned_fixed"] = by["online, share 1.0"]["throughput_rps"] / tuned["throughput_rps"]
        out["tuned_fixed_link_load"] = tuned["link_load"]
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    profile = SpeedProfile.from_file(args.profile)
    points = tuple((n, float(b)) for n, b in profile.kv_points("none"))
    prompts, gaps = paper_workload(args.requests)
    rows, summaries = [], []
    for gbps in (float(x) for x in args.bandwidths_gbps.split(",")):
        base = Sim(profile.prefill_seconds, lambda n: args.local_slowdown * profile.prefill_seconds(n),
                   lambda n: interpolate(points, n), args.prefill, args.decode, gbps * 1e9)
        capacity = run(base, fixed(0), 1e9, prompts, gaps)["throughput_rps"]  # all-remote, everything at once
        for load in (float(x) for x in args.loads.split(",")):
            steady = cell(base, capacity * load, prompts, gaps, False, None)
            sweep = [r for r in steady if r["policy"].startswith("fixed t=") or r["policy"] == "all-remote"]
            tuned = max(sweep, key=lambda r: r["throughput_rps"])["threshold"]
            for scenario, cell_rows in (("steady", steady),
                                        ("halved", cell(base, capacity * load, prompts, gaps, True, tuned))):
                head = {"bandwidth_gbps": gbps, "load": load, "arrival_rps": capacity * load, "link": scenario}
                rows += [{**head, **r} for r in cell_rows]
                summaries.append({**head, **summary(cell_rows, base.link_share)})
    return {"provenance": provenance(), "setup": vars(args), "model": simulate.__doc__, "rows": rows,
            "summary": summaries}


def show(result: dict[str, Any]) -> None:
    args = result["setup"]
    table = Table(title=f"simulated cluster: {args['prefill']} remote prefill, {args['decode']} decode, local "
                        f"prefill {args['local_slowdown']:g}x slower; throughput req/s")
    for col in ("Gbit/s", "load", "link", "best fixed", "best", "its link load", "online", "its link load",
                "vs best", "vs best within 70 %", "share 1.0 vs best", "vs tuned", "share 1.0 vs tuned",
                "tuned link load"):
        table.add_column(col, justify="right")
    for s in result["summary"]:
        def opt(key: str, s: dict[str, Any] = s) -> str:
            return "" if key not in s else f"{s[key]:.3f}"
        table.add_row(f"{s['bandwidth_gbps']:g}", f"{s['load']:.1f}", s["link"], s["best_fixed"],
                      f"{s['best_fixed_rps']:.3f}", f"{s['best_fixed_link_load']:.0%}", f"{s['online_rps']:.3f}",
                      f"{s['online_link_load']:.0%}", f"{s['online_vs_best_fixed']:.3f}",
                      f"{s['online_vs_best_fixed_within_share']:.3f}", f"{s['online_share1_vs_best_fixed']:.3f}",
                      opt("online_vs_tuned_fixed"), opt("online_share1_vs_tuned_fixed"),
                      "" if "tuned_fixed_link_load" not in s else f"{s['tuned_fixed_link_load']:.0%}")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="docs/examples/paper-table5-profile.json")
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--local-slowdown", type=float, default=3.0)
    parser.add_argument("--bandwidths-gbps", default="100,20,10")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--loads", default="0.8,1.3")
    parser.add_argument("--out", default="benchmarks/results/scheduler.json")
    args = parser.parse_args()
    result = measure(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    show(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
