"""The ``prfaas`` command line. Each role or tool registers its own typer sub-app here; heavy imports stay
inside the command functions so that ``prfaas --help`` and the light roles start fast."""

from __future__ import annotations

import typer
from typer._click.core import Command, Context, Parameter
from typer._click.exceptions import NoArgsIsHelpError

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
    port: int = typer.Option(8000, help="router port"),
    offload_threshold: int = typer.Option(128, help="prompts longer than this go to remote prefill"),
    max_tokens: int = typer.Option(40, help="tokens to generate per answer"),
    handoff: bool = typer.Option(False, "--handoff", help="only the KV hand-off between two processes"),
    codec: str = typer.Option("none", help="with --handoff: KV codec none | bf16 | fp8 | int8 | int4"),
) -> None:
    """A whole deployment on this machine, a local and a remote request in relay and direct mode."""
    if handoff:
        from prfaas.demo import run_demo

        run_demo(model=model, prompt="What is the capital of France? Answer in one sentence.", codec=codec,
                 max_new_tokens=max_tokens)
        return
    from prfaas.services.demo import run_full_demo

    run_full_demo(model=model, port=port, threshold=offload_threshold, max_tokens=max_tokens)


@app.command()
def measure(
    model: str = typer.Option("smollm2-135m", help="built-in name, HF directory or .gguf file"),
    seq_len: list[str] = typer.Option(None, "--seq-len", help="prompt lengths (repeat or 128,512)"),
    codec: list[str] = typer.Option(None, "--codec", help="codecs to size (repeat); default none"),
    dtype: str = typer.Option("float32", help="engine dtype"),
    device: str = typer.Option("cpu", help="cpu | cuda | cuda:N | auto (the GPU where torch sees one)",
                               callback=lambda value: check_device(value)),
    repeats: int = typer.Option(1, help="prefills per length; the fastest counts"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Run the real engine: measured KV bytes per codec, prefill seconds per length, Φ_kv in Gbps."""
    import json

    from prfaas.engine.measure import render_measure, run_measure
    from prfaas.terminal import console
    from prfaas.units import parse_lengths

    out = run_measure(model=model, lengths=parse_lengths(seq_len or ["128", "512"]),
                      codecs=codec or ["none"], dtype=dtype, repeats=repeats, device=device)
    if as_json:
        typer.echo(json.dumps(out))
    else:
        render_measure(out, console())

# Sub-apps of other packages are added here, e.g. app.add_typer(plan_app, name="plan").
from prfaas.audit.cli import app as audit_app  # noqa: E402
from prfaas.lab.cli import app as lab_app  # noqa: E402
from prfaas.plan.cli import app as plan_app  # noqa: E402
from prfaas.probe.cli import app as probe_app  # noqa: E402
from prfaas.serve import check_device, serve_app, up  # noqa: E402

app.add_typer(plan_app, name="plan")
app.add_typer(probe_app, name="probe")
app.add_typer(serve_app, name="serve")
app.command("up")(up)
from prfaas.bench.cli import app as bench_app  # noqa: E402

app.add_typer(bench_app, name="bench")
app.add_typer(audit_app, name="audit")
app.add_typer(lab_app, name="lab")
from prfaas.admin.cli import app as admin_app  # noqa: E402
from prfaas.tenancy.cli import store_key, usage  # noqa: E402

admin_app.command("usage")(usage)
admin_app.command("store-key")(store_key)
app.add_typer(admin_app, name="admin")
from prfaas.security.cli import app as certs_app  # noqa: E402

app.add_typer(certs_app, name="certs")


def main() -> None:
    """Every failure a user can cause is one line on stderr and exit status 2: a bad option value or usage (the
    parser's own message), and a ``PrfaasError`` from a command (its wire code and message)."""
    command = typer.main.get_command(app)
    polish(command)
    try:
        code = command.main(prog_name="prfaas", standalone_mode=False)
    except NoArgsIsHelpError as exc:  # `prfaas lab`: the help, as click prints it
        typer.echo(exc.format_message(), err=True)
        raise SystemExit(2) from None
    except typer.TyperException as exc:  # usage errors, bad parameter values, unreadable files
        typer.echo(f"error: {exc.format_message()}{_hint(exc)}", err=True)
        raise SystemExit(2) from None
    except typer.Abort:
        typer.echo("aborted", err=True)
        raise SystemExit(1) from None
    except PrfaasError as exc:
        typer.echo(f"error: {exc.code}: {exc.message}", err=True)
        raise SystemExit(2) from exc
    raise SystemExit(code if isinstance(code, int) else 0)


def _hint(exc: Exception) -> str:
    ctx = getattr(exc, "ctx", None)
    return f" (see {ctx.command_path} --help)" if ctx is not None else ""


def polish(command: Command) -> None:
    """Help as a user reads it: a flag shows no value type (typer would print ``<bool>``), and a repeatable
    option shows its element type once, marked repeatable, instead of ``<list[str]>``."""
    for sub in getattr(command, "commands", {}).values():  # a group's sub-commands
        polish(sub)
    help_option = command.get_help_option(Context(command))  # made on first use; made here, it is polished too
    for param in [*command.params, *([help_option] if help_option else [])]:
        if param.metavar is None:
            param.metavar = _metavar(param)


def _metavar(param: Parameter) -> str | None:
    if getattr(param, "is_flag", False):
        return ""
    if getattr(param, "multiple", False) or param.nargs == -1:
        label = param.display_type(None)  # type: ignore[attr-defined]
        return label.replace("list[", "").replace("]", "") + " …"
    return None
