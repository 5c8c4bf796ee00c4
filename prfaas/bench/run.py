"""``prfaas bench run``: the acceptance matrix against an OpenAI-compatible target, network conditions applied
through the lab, an optional monolithic baseline, and the report.

Ownership: the run changes the lab's settings only while it runs and puts them back (even on error); it never
starts or stops the target. Failures of single requests are data in the report; only an unreachable target or a
bad matrix raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from prfaas.bench import target as prfaas_target
from prfaas.bench.client import RequestRecord
from prfaas.bench.load import Tick, check_target, model_name, run_cell, token_bound, warm_up
from prfaas.bench.matrix import Cell, Matrix
from prfaas.bench.network import NetworkControl
from prfaas.bench.sampler import Sampler
from prfaas.bench.stats import describe_failures, summarize
from prfaas.bench.verdict import judge, overall
from prfaas.errors import InvalidRequest
from prfaas.tls import https_verify


@dataclass(frozen=True)
class RunOptions:
    target: str
    matrix: Matrix
    matrix_source: str = "built-in"
    baseline: str | None = None  # a URL (measured first, normal network) or a previous results.json
    model: str = ""
    seed: int = 0
    progress: bool = True
    ca: str | None = None  # CA file for https:// targets (--ca, $PRFAAS_CA); None: the system's trust store


class Run:
    def __init__(self, options: RunOptions) -> None:
        self.o = options
        self.matrix = options.matrix  # with the prompt-id range the target accepts, once read from it
        self.verify = https_verify(options.ca)
        self.epoch = time.perf_counter()
        self.model = options.model
        self.sampler: Sampler | None = None
        self.started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.console = Console(stderr=True)
        self.progress: Progress | None = None  # live while ``live`` is entered on a terminal
        self.warm_ups: dict[str, dict[str, Any]] = {}  # URL → its warm-up request's record

    async def execute(self) -> dict[str, Any]:
        o = self.o
        measured = o.baseline if o.baseline and o.baseline.startswith(("http://", "https://")) else None
        previous = self._previous_baseline() if o.baseline and not measured else None  # refused before any dial
        for url in (o.target, *([measured] if measured else [])):
            await check_target(url, self.verify)
        self.model = self.model or await model_name(o.target, self.verify)
        await self._fit_prompt_ids()
        self.warm_ups = {url: _compact(await warm_up(url, self.model, self.matrix, self.epoch, self.verify))
                         for url in (o.target, *([measured] if measured else []))}
        baseline_cells = previous if previous is not None else await self._baseline()
        by_load = {c["load_key"]: c["metrics"] for c in baseline_cells if not c.get("skipped")}
        changes_network = any(n != "normal" for n in self.matrix.networks)
        net = NetworkControl(self.matrix.network, target=o.target) if changes_network else None
        sampler = self.sampler = Sampler(self.epoch)
        sampler.start()
        cells: list[dict[str, Any]] = []
        try:
            for cell in self.matrix.cells():
                if cell.network != "normal" and (net is None or not net.available):
                    cells.append({"key": cell.key, "load_key": cell.load_key, "network": cell.network,
                                  "skipped": net.reason if net else "no lab"})
                    continue
                cells.append(await self.cell(o.target, cell, net, by_load.get(cell.load_key)))
        finally:
            if net is not None:
                net.close()
            samples = await sampler.stop()
        return {"meta": self._meta(net), "matrix": self.matrix.to_json(), "baseline_cells": baseline_cells,
                "cells": cells, "samples": samples, **overall(cells)}

    async def _fit_prompt_ids(self) -> None:
        """Draw prompt ids the served model accepts: the matrix's range, cut to the target's vocabulary."""
        m = self.matrix
        high = await token_bound(self.o.target, self.model, m.vocab_high, self.verify)
        if high < m.vocab_high:
            self._say(f"the target takes token ids below {high}; prompts are drawn from [{min(m.vocab_low, high // 2)}"
                      f", {high})")
            self.matrix = dataclasses.replace(m, vocab_low=min(m.vocab_low, high // 2), vocab_high=high)

    def _meta(self, net: NetworkControl | None) -> dict[str, Any]:
        control = "lab" if net and net.available else (net.reason if net else "not needed (normal only)")
        return {"target": self.o.target, "model": self.model, "matrix_source": self.o.matrix_source,
                "prompt_ids": [self.matrix.vocab_low, self.matrix.vocab_high],
                "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
                "baseline": self.o.baseline, "network_control": control,
                "started": self.started, "warm_up": self.warm_ups}

    def _previous_baseline(self) -> list[dict[str, Any]]:
        """The normal-network cells of a previous run's results.json."""
        source = str(self.o.baseline)
        try:
            previous = json.loads(Path(source).read_text())
            return [c for c in previous.get("baseline_cells") or previous["cells"] if c.get("network") == "normal"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidRequest(f"cannot read the baseline {source}: {exc}") from exc

    async def _baseline(self) -> list[dict[str, Any]]:
        """The baseline measured now, at its URL, under the normal network ([] without a baseline)."""
        source = self.o.baseline
        if not source:
            return []
        loads = {c.load_key: c for c in self.matrix.cells()}
        return [await self.cell(source, Cell(c.input_len, c.output_len, c.concurrency, "normal"), None, None,
                                label="baseline") for c in loads.values()]

    async def cell(self, url: str, cell: Cell, net: NetworkControl | None, baseline: dict[str, Any] | None,
                   label: str = "") -> dict[str, Any]:
        m, acceptance = self.matrix, self.matrix.acceptance
        link = await asyncio.to_thread(net.apply, cell.network) if net else None
        before = await prfaas_target.kv_snapshot(url, self.verify)
        counters = await prfaas_target.router_counters(url, self.verify)
        start = time.perf_counter() - self.epoch
        ended = asyncio.Event()
        cut = asyncio.create_task(net.cut_during(self.epoch, ended)) if net and cell.network == "cut" else None
        try:
            with self._ticking(label or cell.key) as tick:
                records = await run_cell(url, self.model, cell, m, self.epoch, self.o.seed, tick, self.verify)
        finally:
            ended.set()
        windows = await cut if cut else []
        wall = time.perf_counter() - self.epoch - start
        after = await prfaas_target.settle(url, acceptance.release_within_s, self.verify)
        ttft_goal = (baseline["ttft_ms"]["p99"] or 0) * (1 + acceptance.ttft_overhead) / 1e3 if baseline \
            else acceptance.ttft_p99_ms / 1e3
        metrics = summarize(records, wall, windows, ttft_goal)
        views = [metrics["transfer"], metrics["transfer_in_fault"] or {}]
        kv_ids = [k for view in views for k in view.pop("kv_ids", [])]
        fallback_ids = [k for view in views for k in view.pop("fallback_kv_ids", [])]
        metrics["kv"] = prfaas_target.kv_release(before, after, kv_ids, acceptance.release_within_s, fallback_ids)
        metrics["router"] = prfaas_target.delta(counters, await prfaas_target.router_counters(url, self.verify))
        metrics["resources"] = self._resources(start, start + wall)
        verdict = {"pass": True, "failed": [], "checks": [], "reference": True} if label == "baseline" \
            else judge(metrics, acceptance, baseline)
        failed = describe_failures(metrics["failures"])
        self._say(f"{label or cell.key}: {metrics['ok']}/{metrics['requests']} ok, TTFT P50 "
                  f"{metrics['ttft_ms']['p50']} ms, {'PASS' if verdict['pass'] else 'FAIL ' + str(verdict['failed'])}"
                  + (f"; failed: {failed}" if failed else ""))
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

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        """A progress bar per running cell on stderr while entered: only on a terminal and without ``--quiet``
        (a log gets the one line per cell of ``_say`` instead)."""
        if not (self.o.progress and self.console.is_terminal):
            yield
            return
        columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=True) as progress:
            self.progress = progress
            try:
                yield
            finally:
                self.progress = None

    @contextlib.contextmanager
    def _ticking(self, label: str) -> Iterator[Tick | None]:
        """The cell's tick (elapsed seconds against the matrix's duration), its bar removed when the cell ends."""
        progress = self.progress
        if progress is None:
            yield None
            return
        task = progress.add_task(label, total=self.matrix.duration_s)
        try:
            yield lambda elapsed: progress.update(task, completed=elapsed)
        finally:
            progress.remove_task(task)

    def _say(self, text: str) -> None:
        if self.o.progress:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)


def _compact(r: RequestRecord) -> dict[str, Any]:
    return {"start": round(r.start, 3), "ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "output_tokens": r.output_tokens,
            "error": r.error, "status": r.status, "route": r.prfaas.get("route"), "reason": r.prfaas.get("reason_code"),
            "fallback": r.prfaas.get("fallback"),
            "transfer_ms": r.prfaas.get("transfer_ms")}


def run_bench(options: RunOptions) -> dict[str, Any]:
    run = Run(options)
    with run.live():
        return asyncio.run(run.execute())
