"""``prfaas bench run``: the acceptance matrix against an OpenAI-compatible target, network conditions applied
through the lab, an optional monolithic baseline, and the report.

Ownership: the run changes the lab's settings only while it runs and puts them back (even on error); it never
starts or stops the target. Failures of single requests are data in the report; only an unreachable target or a
bad matrix raises.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas.bench import target as prfaas_target
from prfaas.bench.client import RequestRecord
from prfaas.bench.load import model_name, run_cell
from prfaas.bench.matrix import Cell, Matrix
from prfaas.bench.network import NetworkControl
from prfaas.bench.sampler import Sampler
from prfaas.bench.stats import summarize
from prfaas.bench.verdict import judge
from prfaas.errors import InvalidRequest


@dataclass(frozen=True)
class RunOptions:
    target: str
    matrix: Matrix
    matrix_source: str = "built-in"
    baseline: str | None = None  # a URL (measured first, normal network) or a previous results.json
    model: str = ""
    seed: int = 0
    progress: bool = True


class Run:
    def __init__(self, options: RunOptions) -> None:
        self.o = options
        self.epoch = time.perf_counter()
        self.model = options.model
        self.sampler: Sampler | None = None
        self.started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    async def execute(self) -> dict[str, Any]:
        o = self.o
        self.model = self.model or await model_name(o.target)
        baseline_cells = await self._baseline()
        by_load = {c["load_key"]: c["metrics"] for c in baseline_cells if not c.get("skipped")}
        net = NetworkControl(o.matrix.network) if any(n != "normal" for n in o.matrix.networks) else None
        sampler = self.sampler = Sampler(self.epoch)
        sampler.start()
        cells: list[dict[str, Any]] = []
        try:
            for cell in o.matrix.cells():
                if cell.network != "normal" and (net is None or not net.available):
                    cells.append({"key": cell.key, "load_key": cell.load_key, "network": cell.network,
                                  "skipped": net.reason if net else "no lab"})
                    continue
                cells.append(await self.cell(o.target, cell, net, by_load.get(cell.load_key)))
        finally:
            if net is not None:
                net.close()
            samples = await sampler.stop()
        judged = [c for c in cells if not c.get("skipped")]
        return {"meta": self._meta(net), "matrix": o.matrix.to_json(), "baseline_cells": baseline_cells,
                "cells": cells, "samples": samples, "pass": bool(judged) and all(c["verdict"]["pass"] for c in judged)}

    def _meta(self, net: NetworkControl | None) -> dict[str, Any]:
        control = "lab" if net and net.available else (net.reason if net else "not needed (normal only)")
        return {"target": self.o.target, "model": self.model, "matrix_source": self.o.matrix_source,
                "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
                "baseline": self.o.baseline, "network_control": control,
                "started": self.started}

    async def _baseline(self) -> list[dict[str, Any]]:
        source = self.o.baseline
        if not source:
            return []
        if not source.startswith(("http://", "https://")):
            try:
                previous = json.loads(Path(source).read_text())
            except (OSError, ValueError) as exc:
                raise InvalidRequest(f"cannot read the baseline {source}: {exc}") from exc
            return [c for c in previous.get("baseline_cells") or previous["cells"] if c.get("network") == "normal"]
        loads = {c.load_key: c for c in self.o.matrix.cells()}
        return [await self.cell(source, Cell(c.input_len, c.output_len, c.concurrency, "normal"), None, None,
                                label="baseline") for c in loads.values()]

    async def cell(self, url: str, cell: Cell, net: NetworkControl | None, baseline: dict[str, Any] | None,
                   label: str = "") -> dict[str, Any]:
        m, acceptance = self.o.matrix, self.o.matrix.acceptance
        link = await asyncio.to_thread(net.apply, cell.network) if net else None
        before = await prfaas_target.kv_snapshot(url)
        counters = await prfaas_target.router_counters(url)
        start = time.perf_counter() - self.epoch
        ended = asyncio.Event()
        cut = asyncio.create_task(net.cut_during(self.epoch, ended)) if net and cell.network == "cut" else None
        try:
            records = await run_cell(url, self.model, cell, m, self.epoch, self.o.seed,
                                     self._ticker(label or cell.key))
        finally:
            ended.set()
        windows = await cut if cut else []
        wall = time.perf_counter() - self.epoch - start
        after = await prfaas_target.settle(url, acceptance.release_within_s)
        ttft_goal = (baseline["ttft_ms"]["p99"] or 0) * (1 + acceptance.ttft_overhead) / 1e3 if baseline \
            else acceptance.ttft_p99_ms / 1e3
        metrics = summarize(records, wall, windows, ttft_goal)
        views = [metrics["transfer"], metrics["transfer_in_fault"] or {}]
        kv_ids = [k for view in views for k in view.pop("kv_ids", [])]
        fallback_ids = [k for view in views for k in view.pop("fallback_kv_ids", [])]
        metrics["kv"] = prfaas_target.kv_release(before, after, kv_ids, acceptance.release_within_s, fallback_ids)
        metrics["router"] = prfaas_target.delta(counters, await prfaas_target.router_counters(url))
        metrics["resources"] = self._resources(start, start + wall)
        verdict = {"pass": True, "failed": [], "checks": [], "reference": True} if label == "baseline" \
            else judge(metrics, acceptance, baseline)
        self._say(f"{label or cell.key}: {metrics['ok']}/{metrics['requests']} ok, TTFT P50 "
                  f"{metrics['ttft_ms']['p50']} ms, {'PASS' if verdict['pass'] else 'FAIL ' + str(verdict['failed'])}")
        return {"key": cell.key, "load_key": cell.load_key, "network": cell.network,
                "link": link.to_json() if link else None, "span": [round(start, 2), round(start + wall, 2)],
                "fault_window": [round(w, 2) for w in windows[0]] if windows else None,
                "fault_windows": [[round(w, 2) for w in window] for window in windows], "metrics": metrics,
                "verdict": verdict, "records": [_compact(r) for r in records]}

    def _resources(self, start: float, end: float) -> dict[str, float | None]:
        samples = [s for s in (self.sampler.samples if self.sampler else []) if start <= s["t"] <= end + 1]
        cpu = [s["cpu_percent"] for s in samples]
        wan = [s["wan_gbps"] for s in samples if "wan_gbps" in s]
        return {"cpu_percent_mean": round(sum(cpu) / len(cpu), 1) if cpu else None,
                "mem_used_mb_max": max((s["mem_used_mb"] for s in samples), default=None),
                "wan_gbps_mean": round(sum(wan) / len(wan), 4) if wan else None,
                "wan_gbps_max": max(wan, default=None)}

    def _ticker(self, label: str) -> Any:
        if not self.o.progress or not sys.stderr.isatty():
            return None
        return lambda elapsed: self._say(f"  {label}: {elapsed:.0f} s", end="\r")

    def _say(self, text: str, end: str = "\n") -> None:
        if self.o.progress:
            print(f"{text:<100}", end=end, file=sys.stderr, flush=True)


def _compact(r: RequestRecord) -> dict[str, Any]:
    return {"start": round(r.start, 3), "ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "output_tokens": r.output_tokens,
            "error": r.error, "route": r.prfaas.get("route"), "reason": r.prfaas.get("reason_code"),
            "fallback": r.prfaas.get("fallback"),
            "transfer_ms": r.prfaas.get("transfer_ms")}


def run_bench(options: RunOptions) -> dict[str, Any]:
    return asyncio.run(Run(options).execute())
