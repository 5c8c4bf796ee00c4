"""``results.json``, ``report.md``, ``report.html`` and ``report.png`` (TTFT CDFs per cell; throughput, CPU and
WAN use over time with fault windows shaded). Plots need matplotlib; without it the report says so and the rest
is written. Writes only inside ``out``."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from prfaas.bench.provenance import provenance
from prfaas.bench.stats import describe_failures
from prfaas.bench.verdict import verdict_line

COLUMNS = ("cell", "n", "ok %", "TTFT P50", "TTFT P99", "TPOT P50", "ITL P99", "E2E P99", "tok/s", "goodput",
           "xfer ok %", "xfer P99", "retry %", "degr %", "KV on time", "verdict")


def _fmt(value: Any, pct: bool = False) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if pct:
        return f"{100 * value:.1f}"
    return f"{value:.0f}" if isinstance(value, float) and value >= 100 else f"{value:.4g}"


def row(cell: dict[str, Any]) -> list[str]:
    if cell.get("skipped"):
        return [cell["key"], *["–"] * (len(COLUMNS) - 2), f"skipped: {cell['skipped']}"]
    m, t = cell["metrics"], cell["metrics"]["transfer"]
    v = cell["verdict"]
    verdict = "reference" if v.get("reference") else "PASS" if v["pass"] else "FAIL: " + ", ".join(v["failed"])
    failed = [f"{g['count']} × {'HTTP ' + str(g['status']) + ' ' if g['status'] else ''}{g['code']}"
              for g in m.get("failures", [])]
    verdict += f" ({', '.join(failed)} failed)" if failed else ""
    return [cell["key"], str(m["requests"]), _fmt(m["success_rate"], True), _fmt(m["ttft_ms"]["p50"]),
            _fmt(m["ttft_ms"]["p99"]), _fmt(m["tpot_ms"]["p50"]), _fmt(m["itl_ms"]["p99"]),
            _fmt(m["e2e_ms"]["p99"]), _fmt(m["output_tokens_per_s"]), _fmt(m["goodput_rps"]),
            _fmt(t["success_rate"], True), _fmt(t["transfer_ms"]["p99"]), _fmt(t["retry_rate"], True),
            _fmt(t["degrade_rate"], True), _fmt(m.get("kv", {}).get("on_time")), verdict]


def table(cells: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(row(c)) + " |" for c in cells])


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    out = [f"# prfaas acceptance report: {meta['target']}", "",
           f"Started {meta['started']}; matrix {meta['matrix_source']}; network control: {meta['network_control']}; "
           f"baseline: {meta['baseline'] or 'none (absolute TTFT P99 limit)'}; model {meta.get('model') or '?'}; "
           f"load average at the end {meta.get('loadavg_1m_at_end', '?')} on {meta.get('cpus', '?')} CPUs; "
           f"prompt token ids drawn from {_ids(meta)}. Verdict: **{verdict_line(results)}**.", "",
           "Latencies in ms; TTFT limits are the baseline × (1 + "
           f"{results['matrix']['acceptance']['ttft_overhead']}); transfer figures exclude requests that overlapped a "
           "fault window (shown separately in results.json).", "", table(results["cells"]), ""]
    base = results.get("baseline_cells") or []
    if base:
        out += ["## Monolithic baseline", "", table(base), ""]
    out += ["## Why cells failed", ""]
    for cell in results["cells"]:
        for c in (cell.get("verdict") or {}).get("checks", []):
            if c["pass"] is False:
                out.append(f"- {cell['key']}: {c['name']} = {c['value']} (limit {c['limit']})")
    out += ["", "## Failed requests", ""]
    for cell in [*base, *results["cells"]]:
        said = describe_failures((cell.get("metrics") or {}).get("failures", []))
        if said:
            out.append(f"- {cell['key']}: {said}")
    out += ["", f"Plot: {results.get('plot') or 'not drawn (' + str(results.get('plot_error')) + ')'}", ""]
    return "\n".join(out)


def _ids(meta: dict[str, Any]) -> str:
    low, high = meta.get("prompt_ids") or ("?", "?")
    return f"[{low}, {high})"


def write(out: Path, results: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        plot(out / "report.png", results)
        results["plot"] = "report.png"
    except ImportError as exc:
        results["plot_error"] = f"matplotlib is not installed: {exc}"
    results.setdefault("provenance", provenance())
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (out / "report.md").write_text(text)
    img = '<img src="report.png" style="max-width:100%">' if results.get("plot") else ""
    (out / "report.html").write_text(f"<!doctype html><meta charset=utf-8><title>prfaas acceptance</title>"
                                     f"<pre>{html.escape(text)}</pre>{img}")


def plot(path: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, over) = plt.subplots(1, 2, figsize=(14, 5))
    for cell in results["cells"]:
        ttft = sorted(r["ttft_s"] * 1e3 for r in cell.get("records", []) if r.get("ttft_s") is not None)
        if ttft:
            cdf.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=cell["key"])
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF per cell", xscale="log")
    cdf.legend(fontsize=6)
    samples = results.get("samples", [])
    t = [s["t"] for s in samples]
    over.plot(t, [s["cpu_percent"] for s in samples], label="CPU %")
    over.plot(t, [100 * s.get("wan_gbps", 0.0) for s in samples], label="WAN Gbit/s × 100")
    done = sorted(r["start"] + r["e2e_s"] for c in results["cells"] for r in c.get("records", []) if r.get("e2e_s"))
    over.plot(done, [i + 1 for i in range(len(done))], label="requests done (cumulative)")
    for cell in results["cells"]:
        for window in cell.get("fault_windows") or ([cell["fault_window"]] if cell.get("fault_window") else []):
            over.axvspan(*window, color="red", alpha=0.2)
        if cell.get("span"):
            over.axvline(cell["span"][0], color="grey", lw=0.5)
    over.set(xlabel="run time (s)", title="Throughput and resources over time (red: link cut)")
    over.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
