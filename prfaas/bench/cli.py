"""``prfaas bench``: the sub-app every benchmark command registers on. Heavy imports stay inside commands."""

from __future__ import annotations

import typer

from prfaas.bench.run_cli import run
from prfaas.bench.transfer import transfer

app = typer.Typer(help="Benchmarks: the KV data plane, and the acceptance matrix.", no_args_is_help=True)
app.command("transfer")(transfer)
app.command("run")(run)
