"""``prfaas lab up|down|set|status``: the lab on this host (root, network namespaces, tc, iptables): dc-a (prefill)
and one decode datacenter (dc-b), or several (``--decode-dcs 2``: dc-b and dc-c), each on its own WAN link to dc-a.

Without root or namespaces every command says why and exits with status 2 (``LabUnavailable``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import typer
import yaml

from prfaas.errors import InvalidRequest
from prfaas.lab.lab import Lab
from prfaas.lab.spec import MAX_DECODE_DCS, LinkSettings, Topology
from prfaas.units import parse_duration, parse_fraction, parse_rate

app = typer.Typer(help="Datacenters on this host: namespace dc-a (prefill) and dc-b (dc-c, …) each joined to it "
                  "by its own shaped veth WAN.", no_args_is_help=True)

RATE = typer.Option(None, "--rate", help="WAN rate each way, e.g. 1gbit; 'none' removes shaping")
DELAY = typer.Option(None, "--delay", help="one-way delay each way, e.g. 10ms (RTT ≈ 2×)")
JITTER = typer.Option(None, "--jitter", help="uniform ± jitter each way, e.g. 2ms")
LOSS = typer.Option(None, "--loss", help="random loss each way, e.g. 0.01 or 1%")
MTU = typer.Option(None, "--mtu", min=576, max=65535, help="WAN MTU in bytes (default: unchanged, 1500 at lab up)")
LINK_KEYS = ("rate", "delay", "jitter", "loss", "mtu")
LINK = typer.Option(None, "--link", help="the link to change, e.g. dc-a:dc-c (or dc-c); default: every link")


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


def _settings(base: LinkSettings, changes: dict[str, Any]) -> LinkSettings:
    link = base.replace(**{k: v for k, v in changes.items() if k != "rate"})
    return dataclasses.replace(link, rate=changes["rate"]) if "rate" in changes else link


def _from_file(path: str, base: LinkSettings, decode_dcs: int) -> tuple[Topology, dict[str, LinkSettings]]:
    """A topology file: ``decode_dcs`` and, per link name, settings spelled as the flags (``rate: 10gbit``,
    ``delay: 2.5ms``, ``jitter``, ``loss``, ``mtu``); a link not named keeps the flags' settings."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidRequest(f"lab: cannot read the topology {path}: {exc}") from exc
    links = data.get("links") or {} if isinstance(data, dict) else None
    if not isinstance(links, dict) or not all(isinstance(v, dict | None) for v in links.values()):
        raise InvalidRequest(f"lab: {path} must be a mapping with `links: {{NAME: {{rate: …, delay: …}}}}`")
    unknown = sorted({*data} - {"decode_dcs", "links"}) + sorted(
        f"{name}.{key}" for name, values in links.items() for key in (values or {}) if key not in LINK_KEYS)
    if unknown:
        raise InvalidRequest(f"lab: unknown keys in {path}: {', '.join(unknown)} (links take {', '.join(LINK_KEYS)})")
    topo = Topology(decode_dcs=int(data.get("decode_dcs", decode_dcs)))
    return topo, {topo.wire(name).name: _link_from_file(base, values or {}) for name, values in links.items()}


def _link_from_file(base: LinkSettings, values: dict[str, Any]) -> LinkSettings:
    rate, delay, jitter, loss = (None if values.get(k) is None else str(values[k]) for k in LINK_KEYS[:4])
    mtu = values.get("mtu")
    return _settings(base, _changes(rate, delay, jitter, loss, None if mtu is None else int(mtu)))


@app.command("up")
def up(rate: str | None = RATE, delay: str | None = DELAY, jitter: str | None = JITTER, loss: str | None = LOSS,
       mtu: int | None = MTU,
       decode_dcs: int = typer.Option(1, "--decode-dcs", min=1, max=MAX_DECODE_DCS,
                                      help="decode datacenters (dc-b, dc-c, …), each on its own link to dc-a"),
       topology: str | None = typer.Option(None, "--topology", help="a YAML file: decode_dcs and each link's "
                                           "settings (docs/lab.md); the flags set the links it does not name")
       ) -> None:
    """Create dc-a and the decode datacenters, every link with these settings (change one with `lab set --link`);
    the router address of each decode datacenter for clients in this namespace is printed."""
    base = _settings(LinkSettings(), _changes(rate, delay, jitter, loss, mtu))
    topo, links = _from_file(topology, base, decode_dcs) if topology else (Topology(decode_dcs=decode_dcs), {})
    lab = Lab(base, topo, links)
    lab.up()
    for wire in lab.topo.wires:
        typer.echo(f"lab up: {lab.topo.ns_a} ({wire.wan_a}) ⇄ {wire.ns} ({wire.wan_b}); from here {wire.ns} is "
                   f"{wire.public}; link {wire.name} {json.dumps(lab.current(wire.name).to_json())}")


@app.command("down")
def down() -> None:
    """Stop the delayer and remove the namespaces (safe when the lab is half built or gone)."""
    Lab().down()
    typer.echo("lab down")


@app.command("set")
def set_(rate: str | None = RATE, delay: str | None = DELAY, jitter: str | None = JITTER, loss: str | None = LOSS,
         mtu: int | None = MTU, cut: bool = typer.Option(False, "--cut", help="drop every WAN packet both ways"),
         restore: bool = typer.Option(False, "--restore", help="undo --cut"), link_name: str | None = LINK) -> None:
    """Change a WAN while traffic flows (one link with --link, else every link); settings not named keep their
    value."""
    changes = _changes(rate, delay, jitter, loss, mtu)
    lab = Lab()
    for name in lab.link_names(link_name):
        link = _settings(lab.current(name).replace(cut=True if cut else (False if restore else None)), changes)
        lab.reset(link, name)
        typer.echo(f"lab set: {json.dumps(link.to_json())}" if len(lab.topo.wires) == 1 else
                   f"lab set {name}: {json.dumps(link.to_json())}")


@app.command("status")
def status(as_json: bool = typer.Option(False, "--json", help="one JSON object on the last line")) -> None:
    """Whether the lab is up, its settings, the delayer, and what the kernel reports."""
    info = Lab().status()
    if as_json:
        typer.echo(json.dumps(info))
        return
    typer.echo(f"up: {info['up']}  namespaces: {' '.join(info['namespaces'])}")
    for name, link in info["links"].items():
        typer.echo(f"{name}  link: {json.dumps(link['settings'])}  delayer: {link['delayer']}  "
                   f"clients reach {name.split(':')[1]} at {link['router_address']}")
        for key, value in link["kernel"].items():
            typer.echo(f"  {key}: {value or '-'}")
