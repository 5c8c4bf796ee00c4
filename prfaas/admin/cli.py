"""``prfaas admin drain|check|weight|recommend``: operator commands against a running router."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import typer

app = typer.Typer(help="Operate a running deployment: drain, pre-flight check, canary weights, scaling advice.",
                  no_args_is_help=True)
ROUTER = typer.Option("http://127.0.0.1:8000", "--router", help="the router's URL")
JSON = typer.Option(False, "--json", help="print one JSON object on the last line")


def _get(router: str, path: str) -> Any:
    reply = httpx.get(f"{router.rstrip('/')}{path}", timeout=10.0)
    reply.raise_for_status()
    return reply.json()


@app.command()
def drain(instance: str = typer.Argument(..., help="instance id, as in /admin/instances"), router: str = ROUTER,
          wait: bool = typer.Option(True, "--wait/--no-wait", help="wait until the instance has left"),
          timeout: str = typer.Option("10m", "--timeout", help="how long --wait waits")) -> None:
    """Stop routing to INSTANCE, let it finish what it holds, and have it exit (as SIGTERM does)."""
    from prfaas.units import parse_duration

    reply = httpx.post(f"{router.rstrip('/')}/admin/drain/{instance}", timeout=10.0)
    if reply.status_code != 200:
        typer.echo(f"error: {reply.json().get('error', {}).get('message', reply.text)}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{instance}: draining (deadline {reply.json().get('deadline_s', '?')} s)")
    started, deadline = time.monotonic(), time.monotonic() + parse_duration(timeout)
    while wait and time.monotonic() < deadline:
        if instance not in {i["instance_id"] for i in _get(router, "/admin/instances")}:
            typer.echo(f"{instance}: drained and gone after {time.monotonic() - started:.1f} s")
            return
        time.sleep(0.5)
    if wait:
        typer.echo(f"{instance}: still registered after {timeout}", err=True)
        raise typer.Exit(1)


@app.command()
def check(router: str = ROUTER, as_json: bool = JSON) -> None:
    """Pre-flight: compare fingerprints, blob format versions and config digests of every registered instance
    and print what would break. Exit status 1 when something would."""
    from prfaas.admin.check import ERROR, render
    from prfaas.admin.check import check as run_check

    instances, pools = _get(router, "/admin/instances"), _get(router, "/admin/pools")
    findings = run_check(instances, pools)
    typer.echo(render(findings, len(instances)))
    if as_json:
        typer.echo(json.dumps({"instances": len(instances), "findings": [f.__dict__ for f in findings]}))
    if any(f.level == ERROR for f in findings):
        raise typer.Exit(1)


@app.command()
def weight(model: str = typer.Argument(..., help="model name or pool key"),
           value: float = typer.Argument(..., help="traffic weight (relative to the other pools)"),
           router: str = ROUTER) -> None:
    """Shift traffic between pools (a canary step): set one pool's weight on the live router."""
    reply = httpx.post(f"{router.rstrip('/')}/admin/pools", json={"weights": {model: value}}, timeout=10.0)
    reply.raise_for_status()
    for pool in reply.json()["pools"]:
        typer.echo(f"pool {pool['pool']} {pool['model']}: weight {pool['weight']}, instances {pool['instances']}")


@app.command()
def recommend(profile: str = typer.Option(..., "--profile", help="speed profile JSON from `prfaas measure`"),
              link: str = typer.Option("10gbit", "--link", help="measured available bandwidth between datacenters"),
              router: str = ROUTER,
              signals: str | None = typer.Option(None, "--signals", help="a saved /admin/signals JSON instead"),
              utilisation: float = typer.Option(0.7, "--utilisation", help="target load of each instance"),
              budget: str = typer.Option("500ms", "--local-prefill-budget", help="longest prefill left to decode"),
              as_json: bool = JSON) -> None:
    """Recommended prefill:decode instance counts and offload threshold from the router's live signals."""
    from prfaas.admin.recommend import recommend as advise
    from prfaas.admin.recommend import render
    from prfaas.plan.profile import SpeedProfile
    from prfaas.units import parse_duration, parse_rate

    data = json.loads(Path(signals).read_text()) if signals else _get(router, "/admin/signals")
    advice = advise(data, SpeedProfile.from_file(profile), parse_rate(link), target_utilisation=utilisation,
                    local_prefill_budget_s=parse_duration(budget))
    typer.echo(render(advice))
    if as_json:
        typer.echo(json.dumps(advice.to_json()))
