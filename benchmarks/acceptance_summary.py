"""The report of a full acceptance run (``benchmarks/acceptance_full.py``): reads ``summary.json`` and every model's
``results.json`` under DIR and writes ``DIR/report.md`` — per model the table, the plot, every failed check with its
measured value and limit, and for TTFT failures of remote cells the transfer's share of the TTFT — with the load
average of the machine. A hand-written ``DIR/findings.md``, when present, is included after the headline.

    .venv/bin/python benchmarks/acceptance_summary.py docs/reports/acceptance-full
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from prfaas.bench.report import table


def _r(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def headline(models: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| model | cells judged | pass | fail | failed checks (cells) | load avg 1 min (min / mean / max) "
             "| wall |",
             "|---|---|---|---|---|---|---|"]
    for m in models:
        r = results.get(m["model"])
        if r is None:
            lines.append(f"| {m['model']} | – | – | – | run failed (exit {m['exit']}) | – | {m['wall_s']:.0f} s |")
            continue
        judged = [c for c in r["cells"] if not c.get("skipped")]
        passed = sum(1 for c in judged if c["verdict"]["pass"])
        counts: dict[str, int] = {}
        for c in judged:
            for name in c["verdict"]["failed"]:
                counts[name] = counts.get(name, 0) + 1
        failed = ", ".join(f"{k} ({v})" for k, v in sorted(counts.items())) or "none"
        load = m["loadavg_1m"]
        lines.append(f"| {m['model']} | {len(judged)} | {passed} | {len(judged) - passed} | {failed} | "
                     f"{_r(load['min'])} / {_r(load['mean'])} / {_r(load['max'])} | {m['wall_s']:.0f} s |")
    return lines


def why(cell: dict[str, Any], baseline: dict[str, Any] | None) -> list[str]:
    """Every failed check; for TTFT, how much of it the KV transfer took and what link rate the limit implies."""
    out = []
    m = cell["metrics"]
    t = m["transfer"]
    for check in cell["verdict"]["checks"]:
        if check["pass"] is not False:
            continue
        line = f"- `{cell['key']}`: {check['name']} = {check['value']} (limit {check['limit']})"
        if check["name"].startswith("ttft") and t.get("transfer_ms", {}).get("p50") and t.get("remote_ok"):
            per_blob = t["kv_bytes"] / t["remote_ok"]
            xfer = t["transfer_ms"]["p50"]
            base = (baseline or {}).get("ttft_ms", {}).get("p50")
            line += (f"; KV {per_blob / 1e6:.1f} MB per request, pull P50 {xfer:.0f} ms (it starts with the "
                     f"prefill; bytes / pull time = {per_blob * 8 / xfer / 1e6:.2f} Gbit/s)")
            if base:
                line += f"; monolithic TTFT P50 {base:.0f} ms"
        if check["name"] == "degrade_rate":
            line += f"; {t['degraded']} of {t['prfaas_responses']} requests kept local or fell back"
        if check["name"] == "success_rate":
            line += f"; errors {m['errors']}"
        out.append(line)
    return out


def model_section(name: str, r: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    judged = [c for c in r["cells"] if not c.get("skipped")]
    base = {c["load_key"]: c["metrics"] for c in r.get("baseline_cells") or [] if not c.get("skipped")}
    load = meta["loadavg_1m"]
    out = [f"## {name}", "",
           f"Verdict **{'PASS' if r['pass'] else 'FAIL'}**: {sum(c['verdict']['pass'] for c in judged)} of "
           f"{len(judged)} cells pass. Wall {meta['wall_s']:.0f} s; load average (1 min) "
           f"{_r(load['min'])}–{_r(load['max'])} (mean {_r(load['mean'])}) on {r['meta'].get('cpus')} CPUs. "
           f"Matrix: [`{name}/matrix.yaml`]({name}/matrix.yaml)"
           f", deployment config: [`{name}/deploy-config.yaml`]({name}/deploy-config.yaml); full data "
           f"[`{name}/results.json`]({name}/results.json).", "",
           "Monolithic baseline (every prompt prefilled by the decode instance, 127.0.0.1, no WAN):", "",
           table(r.get("baseline_cells") or []), "", "Disaggregated through the lab:", "", table(r["cells"]), "",
           f"![{name}]({name}/report.png)", "", "Why cells failed:", ""]
    reasons = [line for c in judged for line in why(c, base.get(c["load_key"]))]
    out += reasons or ["- none"]
    return [*out, ""]


def soak_text(soak: dict[str, Any] | None) -> str:
    if not soak:
        return ""
    return (f"; then a soak of {soak['duration_s'] / 60:g} min per condition ({soak['entry']}, "
            f"in{soak['input_len']}-out{soak['output_len']}-c{soak['concurrency']}, the cut repeating every "
            f"{soak['cut_every_s']} s)")


def write_summary(directory: Path) -> str:
    summary = json.loads((directory / "summary.json").read_text())
    results = {m["model"]: json.loads((directory / m["model"] / "results.json").read_text())
               for m in summary["models"] if (directory / m["model"] / "results.json").exists()}
    cfg = summary["config"]
    net = cfg["network"]
    load = summary["loadavg_1m"]
    lines = ["# prfaas full acceptance run", "",
             f"Started {summary['started']} at commit `{summary['commit']}`, {summary['cpus']} CPUs shared with other "
             f"work; wall {summary['wall_s'] / 60:.1f} min; load average (1 min, every 10 s) {_r(load['min'])}–"
             f"{_r(load['max'])}, mean {_r(load['mean'])}. Lab WAN {cfg['link_rate']} (tbf) each way; "
             "conditions: normal; "
             f"delay {net['delay_ms']} ms ± {net['jitter_ms']} ms one-way"
             f"{' at ' + net['delay_rate'] if net.get('delay_rate') else ''}; loss {100 * net['loss']:g} % each way; "
             f"cut of {net['cut_s']} s starting {net['cut_at_s']} s into the cell. Cells of {cfg['cell_s']} s"
             f"{soak_text(cfg.get('soak'))}. "
             f"Criteria per cell: TTFT P50 and P99 ≤ monolithic baseline × {1 + cfg['acceptance']['ttft_overhead']}, "
             f"success ≥ {100 * cfg['acceptance']['success_rate']:g} %, transfer success ≥ "
             f"{100 * cfg['acceptance']['transfer_success']:g} %, retries ≤ {100 * cfg['acceptance']['retry_rate']:g}"
             f" %, degradations ≤ {100 * cfg['acceptance']['degrade_rate']:g} %, every KV blob released within "
             f"{cfg['acceptance']['release_within_s']} s. Produced by `benchmarks/acceptance_full.py` "
             "(`benchmarks/acceptance-full.yaml`).", "", *headline(summary["models"], results), ""]
    findings = directory / "findings.md"
    if findings.exists():
        lines += [findings.read_text().rstrip(), ""]
    for meta in summary["models"]:
        if meta["model"] in results:
            lines += model_section(meta["model"], results[meta["model"]], meta)
    text = "\n".join(lines)
    (directory / "report.md").write_text(text)
    return text


if __name__ == "__main__":
    write_summary(Path(sys.argv[1]))
    print(f"wrote {Path(sys.argv[1]) / 'report.md'}")
