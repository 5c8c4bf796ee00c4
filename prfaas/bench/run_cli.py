"""``prfaas bench run``: the acceptance matrix against any OpenAI-compatible endpoint; exit status 1 when
acceptance fails, 2 on a usage error (bad matrix, unreadable baseline)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from prfaas.units import parse_duration, parse_lengths


def run(
    target: str = typer.Option(..., "--target", help="the endpoint's base URL, e.g. http://10.201.0.2:8000"),
    out: Path = typer.Option(..., "--out", help="directory for results.json, report.md, report.html, report.png"),
    matrix: str | None = typer.Option(None, "--matrix", help="matrix YAML (default: the documents' table)"),
    quick: bool = typer.Option(False, "--quick", help="the few-minute profile (1K prompts, 5 s cells)"),
    input_len: list[str] = typer.Option([], "--input-len", help="prompt lengths in tokens (comma list or repeat)"),
    output_len: list[str] = typer.Option([], "--output-len", help="output lengths in tokens"),
    concurrency: list[str] = typer.Option([], "--concurrency", help="concurrent clients"),
    duration: str | None = typer.Option(None, "--duration", help="per cell, e.g. 30s (excludes --requests)"),
    requests: int | None = typer.Option(None, "--requests", help="requests per cell (excludes --duration)"),
    network: str | None = typer.Option(None, "--network", help="conditions: normal,delay,loss,cut"),
    baseline: str | None = typer.Option(None, "--baseline",
                                        help="monolithic baseline: its URL (measured first) or a results.json"),
    model: str = typer.Option("", "--model", help="model name to send (default: the target's first model)"),
    seed: int = typer.Option(0, "--seed", help="seed of the random token-id prompts"),
    quiet: bool = typer.Option(False, "--quiet", help="no live progress"),
) -> None:
    """Run the acceptance matrix and write the report; exit 1 when any cell fails acceptance."""
    from prfaas.bench.matrix import load_matrix
    from prfaas.bench.report import table, write
    from prfaas.bench.run import RunOptions, run_bench

    m = load_matrix(matrix, "quick" if quick else "acceptance")
    if duration is not None:
        m = dataclasses.replace(m, duration_s=parse_duration(duration), requests=None)
    elif requests is not None:
        m = dataclasses.replace(m, duration_s=None, requests=requests)
    m = m.replace(input_lens=tuple(parse_lengths(input_len)) or None,
                  output_lens=tuple(parse_lengths(output_len)) or None,
                  concurrency=tuple(parse_lengths(concurrency)) or None,
                  networks=tuple(n.strip() for n in network.split(",") if n.strip()) if network else None)
    results = run_bench(RunOptions(target=target.rstrip("/"), matrix=m, baseline=baseline, model=model, seed=seed,
                                   matrix_source=matrix or ("quick" if quick else "acceptance"),
                                   progress=not quiet))
    write(out, results)
    typer.echo(table(results["cells"]))
    typer.echo(f"acceptance: {'PASS' if results['pass'] else 'FAIL'}; report in {out}/report.md")
    if not results["pass"]:
        raise typer.Exit(1)
