"""``prfaas bench run``: the acceptance matrix against any OpenAI-compatible endpoint; exit status 0 only when every
cell ran and passed, 1 when a cell failed or was skipped (the verdict then says "not judged" and why), 2 on a usage
error (bad matrix, unreadable baseline)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from prfaas.tls import CA_ENV
from prfaas.units import parse_duration, parse_lengths


def run(
    target: str = typer.Option(..., "--target", metavar="<url>",
                               help="the endpoint's base URL, e.g. http://10.201.0.2:8000"),
    out: Path = typer.Option(..., "--out", file_okay=False,
                             help="directory for results.json, report.md, report.html, report.png"),
    matrix: Path | None = typer.Option(None, "--matrix", exists=True, dir_okay=False,
                                       help="matrix YAML (default: prfaas/bench/acceptance.yaml, the documents' "
                                       "table)"),
    quick: bool = typer.Option(False, "--quick", help="the few-minute profile (1K prompts, 5 s cells)"),
    input_len: list[str] = typer.Option([], "--input-len", metavar="<lengths>",
                                        help="prompt lengths in tokens (comma list or repeat; default: the matrix's)"),
    output_len: list[str] = typer.Option([], "--output-len", metavar="<lengths>",
                                         help="output lengths in tokens (default: the matrix's)"),
    concurrency: list[str] = typer.Option([], "--concurrency", metavar="<counts>",
                                          help="concurrent clients (default: the matrix's)"),
    duration: str | None = typer.Option(None, "--duration", metavar="<duration>",
                                        help="per cell, e.g. 30s (excludes --requests; default: the matrix's)"),
    requests: int | None = typer.Option(None, "--requests", min=1, help="requests per cell (excludes --duration)"),
    network: str | None = typer.Option(None, "--network", metavar="<conditions>",
                                       help="comma list of normal, delay, loss, cut (default: the matrix's); all but "
                                       "normal need the lab (`prfaas lab up`), which the run sets per cell"),
    baseline: str | None = typer.Option(None, "--baseline", metavar="<url|file>",
                                        help="monolithic baseline: its URL (measured first) or a results.json"),
    model: str = typer.Option("", "--model", help="model name to send (default: the target's first model)"),
    seed: int = typer.Option(0, "--seed", help="seed of the random token-id prompts"),
    ca: str | None = typer.Option(None, "--ca", envvar=CA_ENV, show_envvar=True, metavar="<file>",
                                  help="CA file an https:// target's certificate is checked against (default: the "
                                  "system's trust store)"),
    quiet: bool = typer.Option(False, "--quiet", help="no live progress"),
) -> None:
    """Run the acceptance matrix and write the report; exit 1 unless every cell ran and passed."""
    from prfaas.bench.matrix import load_matrix
    from prfaas.bench.report import table, write
    from prfaas.bench.run import RunOptions, run_bench
    from prfaas.bench.verdict import verdict_line

    m = load_matrix(str(matrix) if matrix else None, "quick" if quick else "acceptance")
    if duration is not None:
        m = dataclasses.replace(m, duration_s=parse_duration(duration), requests=None)
    elif requests is not None:
        m = dataclasses.replace(m, duration_s=None, requests=requests)
    m = m.replace(input_lens=tuple(parse_lengths(input_len)) or None,
                  output_lens=tuple(parse_lengths(output_len)) or None,
                  concurrency=tuple(parse_lengths(concurrency)) or None,
                  networks=tuple(n.strip() for n in network.split(",") if n.strip()) if network else None)
    results = run_bench(RunOptions(target=target.rstrip("/"), matrix=m, baseline=baseline, model=model, seed=seed,
                                   matrix_source=str(matrix) if matrix else ("quick" if quick else "acceptance"),
                                   progress=not quiet, ca=ca))
    write(out, results)
    typer.echo(table(results["cells"]))
    typer.echo(f"acceptance: {verdict_line(results)}; report in {out}/report.md")
    if not results["pass"]:
        raise typer.Exit(1)
