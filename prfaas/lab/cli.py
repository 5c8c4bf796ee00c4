"""``prfaas lab up|down|set|status``: the two-datacenter lab on this host (root, network namespaces, tc, iptables).

Without root or namespaces every command says why and exits with status 2 (``LabUnavailable``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import typer

from prfaas.lab.lab import Lab
from prfaas.lab.spec import LinkSettings
from prfaas.units import parse_duration, parse_fraction, parse_rate

app = typer.Typer(help="Two datacenters on this host: namespaces dc-a and dc-b joined by a shaped veth WAN.",
                  no_args_is_help=True)

RATE = typer.Option(None, "--rate", help="WAN rate each way, e.g. 1gbit; 'none' removes shaping")
DELAY = typer.Option(None, "--delay", help="one-way delay each way, e.g. 10ms (RTT ≈ 2×)")
JITTER = typer.Option(None, "--jitter", help="uniform ± jitter each way, e.g. 2ms")
LOSS = typer.Option(None, "--loss", help="random loss each way, e.g. 0.01 or 1%")
MTU = typer.Option(None, "--mtu", min=576, max=65535, help="WAN MTU in bytes (default: unchanged, 1500 at lab up)")


def _changes(rate: str | None, delay: str | None, jitter: str | None, loss: str | None,
             mtu: int | None) -> dict[str, Any]:
    changes: dict[str, Any] = {"mtu": mtu}
    if rate is not None:
        changes["rate"] = None if rate.lower() in ("none", "0", "") else rate
        if changes["rate"] is not None:
            parse_rate(rate)  # a bad value is refused before the lab is touched
    if delay is not None:
        changes["delay_ms"] = parse_duration(delay) * 1e3
    if jitter is not None:
        changes["jitter_ms"] = parse_duration(jitter) * 1e3
    if loss is not None:
        changes["loss"] = parse_fraction(loss)
    return changes


@app.command("up")
def up(rate: str | None = RATE, delay: str | None = DELAY, jitter: str | None = JITTER, loss: str | None = LOSS,
       mtu: int | None = MTU) -> None:
    """Create dc-a and dc-b; the router address for clients in this namespace is printed."""
    changes = _changes(rate, delay, jitter, loss, mtu)
    lab = Lab(LinkSettings(rate=changes.pop("rate", None)).replace(**changes))
    lab.up()
    typer.echo(f"lab up: {lab.topo.ns_a} ({lab.topo.wan_a}) ⇄ {lab.topo.ns_b} ({lab.topo.wan_b}); "
               f"from here dc-b is {lab.topo.public_b}; link {json.dumps(lab.link.to_json())}")


@app.command("down")
def down() -> None:
    """Stop the delayer and remove the namespaces (safe when the lab is half built or gone)."""
    Lab().down()
    typer.echo("lab down")


@app.command("set")
def set_(rate: str | None = RATE, delay: str | None = DELAY, jitter: str | None = JITTER, loss: str | None = LOSS,
         mtu: int | None = MTU, cut: bool = typer.Option(False, "--cut", help="drop every WAN packet both ways"),
         restore: bool = typer.Option(False, "--restore", help="undo --cut")) -> None:
    """Change the WAN while traffic flows; settings not named keep their value."""
    changes = _changes(rate, delay, jitter, loss, mtu)
    lab = Lab()
    link = lab.current().replace(cut=True if cut else (False if restore else None),
                                 **{k: v for k, v in changes.items() if k != "rate"})
    if "rate" in changes:
        link = dataclasses.replace(link, rate=changes["rate"])
    lab.reset(link)
    typer.echo(f"lab set: {json.dumps(link.to_json())}")


@app.command("status")
def status(as_json: bool = typer.Option(False, "--json", help="one JSON object on the last line")) -> None:
    """Whether the lab is up, its settings, the delayer, and what the kernel reports."""
    info = Lab().status()
    if as_json:
        typer.echo(json.dumps(info))
        return
    typer.echo(f"up: {info['up']}  link: {json.dumps(info['link'])}  delayer: {info['delayer']}")
    for key, value in info["kernel"].items():
        typer.echo(f"  {key}: {value or '-'}")
