"""The ``prfaas`` command line. Each role or tool registers its own typer sub-app here; heavy imports stay
inside the command functions so that ``prfaas --help`` and the light roles start fast."""

from __future__ import annotations

import typer

from prfaas.errors import PrfaasError

app = typer.Typer(
    name="prfaas",
    help="Prefill-as-a-Service: prefill in one datacenter, decode in another, KV over Ethernet.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Prefill-as-a-Service: prefill in one datacenter, decode in another, KV over Ethernet."""


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", help="built-in name, HF directory or .gguf file"),
    prompt: str = typer.Option("What is the capital of France? Answer in one sentence.", help="user message"),
    codec: str = typer.Option("none", help="KV codec: none | bf16 | fp8 | int8 | int4"),
    max_new_tokens: int = typer.Option(32, help="tokens to decode"),
) -> None:
    """Prefill in this process, ship the KV blob to a second process, decode there, show what happened."""
    from prfaas.demo import run_demo

    run_demo(model=model, prompt=prompt, codec=codec, max_new_tokens=max_new_tokens)


# Sub-apps of other packages are added here, e.g. app.add_typer(plan_app, name="plan").
from prfaas.plan.cli import app as plan_app  # noqa: E402
from prfaas.plan.cli import measure as measure_cmd  # noqa: E402
from prfaas.probe.cli import app as probe_app  # noqa: E402
from prfaas.services.cli import serve_app, up  # noqa: E402

app.add_typer(plan_app, name="plan")
app.add_typer(probe_app, name="probe")
app.command("measure")(measure_cmd)
app.add_typer(serve_app, name="serve")
app.command("up")(up)


def main() -> None:
    try:
        app()
    except PrfaasError as exc:
        typer.echo(f"error: {exc.code}: {exc.message}", err=True)
        raise SystemExit(2) from exc
