"""``prfaas admin drain|drain-router|check|weight|rollout|recommend|links``: operator commands against a running router.

Every command takes ``--router``, where the router has API keys ``--api-key`` (or ``$PRFAAS_API_KEY``), and for an
``https://`` router whose CA is not in the system's store ``--ca`` (or ``$PRFAAS_CA``); the key is sent as a bearer
token and never printed. A refusal or an unreachable router prints one line, exit 2.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

from prfaas.admin.client import API_KEY_ENV, AdminError, RouterClient
from prfaas.tls import CA_ENV

app = typer.Typer(help="Operate a running deployment: drain, pre-flight check, canary weights and rollouts, "
                  "scaling advice.", no_args_is_help=True)
ROUTER = typer.Option("http://127.0.0.1:8000", "--router", help="the router's URL")
API_KEY = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_envvar=True, show_default=False,
                       help="an API key of the router, when it has keys (never printed)")
CA = typer.Option(None, "--ca", envvar=CA_ENV, show_envvar=True, metavar="<file>",
                  help="CA file an https:// router's certificate is checked against (`prfaas certs init`'s ca.pem, "
                  "or the CA `prfaas up --tls` prints; default: the system's trust store)")
JSON = typer.Option(False, "--json", help="print one JSON object on the last line")
F = TypeVar("F", bound=Callable[..., Any])


def refusals(fn: F) -> F:
    """An ``AdminError`` (router unreachable or refusing) becomes one line on stderr and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AdminError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@refusals
def drain(instance: str = typer.Argument(..., help="instance id, as in /admin/instances"), router: str = ROUTER,
          api_key: str | None = API_KEY, ca: str | None = CA,
          wait: bool = typer.Option(True, "--wait/--no-wait", help="wait until the instance has left"),
          timeout: str = typer.Option("10m", "--timeout", help="how long --wait waits")) -> None:
    """Stop routing to INSTANCE, let it finish what it holds, and have it exit (as SIGTERM does)."""
    from prfaas.admin.rollout import wait_gone
    from prfaas.units import parse_duration

    timeout_s = parse_duration(timeout)  # a bad value is refused before anything is drained
    client = RouterClient(router, api_key, ca=ca)
    reply = client.post(f"/admin/drain/{instance}")
    typer.echo(f"{instance}: draining (deadline {reply.get('deadline_s', '?')} s)")
    if not wait:
        return
    took = wait_gone(client, instance, timeout_s)
    if took is None:
        typer.echo(f"{instance}: still registered after {timeout}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{instance}: drained and gone after {took:.1f} s")


@app.command("drain-router")
@refusals
def drain_router(router: str = ROUTER, api_key: str | None = API_KEY, ca: str | None = CA,
                 wait: bool = typer.Option(True, "--wait/--no-wait", help="wait until the router has exited"),
                 timeout: str = typer.Option("10m", "--timeout", help="how long --wait waits")) -> None:
    """Drain the router itself (as SIGTERM does): new requests get 503, open streams finish, then it exits."""
    from prfaas.units import parse_duration

    timeout_s = parse_duration(timeout)  # a bad value is refused before anything is drained
    client = RouterClient(router, api_key, timeout_s=5.0, ca=ca)
    reply = client.post("/admin/drain")
    typer.echo(f"router: draining, {reply.get('open_requests', '?')} requests open "
               f"(deadline {reply.get('deadline_s', '?')} s)")
    started, deadline = time.monotonic(), time.monotonic() + timeout_s
    while wait and time.monotonic() < deadline:
        try:
            client.get("/admin/pools")
        except AdminError:  # the router has stopped listening
            typer.echo(f"router: drained and gone after {time.monotonic() - started:.1f} s")
            return
        time.sleep(0.25)
    if wait:
        typer.echo(f"router: still answering after {timeout}", err=True)
        raise typer.Exit(1)


@app.command()
@refusals
def check(router: str = ROUTER, api_key: str | None = API_KEY, ca: str | None = CA, as_json: bool = JSON) -> None:
    """Pre-flight: compare fingerprints, blob format versions and config digests of every registered instance
    and print what would break. Exit status 1 when something would."""
    from prfaas.admin.check import ERROR, render
    from prfaas.admin.check import check as run_check

    client = RouterClient(router, api_key, ca=ca)
    instances, pools = client.get("/admin/instances"), client.get("/admin/pools")
    findings = run_check(instances, pools)
    typer.echo(render(findings, len(instances)))
    if as_json:
        typer.echo(json.dumps({"instances": len(instances), "findings": [f.__dict__ for f in findings]}))
    if any(f.level == ERROR for f in findings):
        raise typer.Exit(1)


@app.command()
@refusals
def weight(model: str = typer.Argument(..., help="model name or pool key"),
           value: float = typer.Argument(..., min=0, help="traffic weight (relative to the other pools)"),
           router: str = ROUTER, api_key: str | None = API_KEY, ca: str | None = CA,
           admit: bool = typer.Option(False, "--admit", help="MODEL names no pool the router knows: admit "
                                      "instances serving a model of that name, at this weight")) -> None:
    """Shift traffic between pools (a canary step): set one pool's weight on the live router."""
    client = RouterClient(router, api_key, ca=ca)
    known = _pool_names(client.get("/admin/pools"))
    if model not in known and not admit:
        raise AdminError(f"no pool is named {model!r} (pools and models: {', '.join(sorted(known)) or 'none'}); "
                         "check the name, or give --admit to admit a model that has not registered yet")
    reply = client.post("/admin/pools", {"weights": {model: value}})
    for pool in reply["pools"]:
        typer.echo(f"pool {pool['pool']} {pool['model']}: weight {pool['weight']}, instances {pool['instances']}")
    if model not in known:
        typer.echo(f"{model}: admitted at weight {value}; no instance serves it yet")
    kept = reply.get("kept_in")
    typer.echo(f"weights kept in {kept}" if kept else "weights live in the router's memory only "
               "(set pool_weights_file to keep them across restarts)")


def _pool_names(pools: dict[str, Any]) -> set[str]:
    """Every name ``weight`` can mean: a registered pool's key or model, or an entry of the configured pools."""
    return {n for p in pools.get("pools", []) for n in (p["pool"], p["model"])} | set(pools.get("configured") or {})


@app.command()
@refusals
def rollout(to: str = typer.Argument(..., help="the new pool: its key, or a model name only it serves"),
            router: str = ROUTER, api_key: str | None = API_KEY, ca: str | None = CA,
            steps: str = typer.Option("10,50,100", "--steps", help="the new pool's weights, out of 100, in order"),
            hold: str = typer.Option("60s", "--hold", help="how long each step runs before the next"),
            drain_old: bool = typer.Option(True, "--drain/--no-drain", help="drain the old pools' instances"),
            timeout: str = typer.Option("10m", "--timeout", help="longest wait for one instance's drain"),
            as_json: bool = JSON) -> None:
    """Move traffic to a new model pool step by step (rolled back on failures), then drain the old pools."""
    from prfaas.admin.rollout import RolloutFailed
    from prfaas.admin.rollout import rollout as run_rollout
    from prfaas.units import parse_duration

    try:
        weights = [float(s) for s in steps.split(",") if s.strip()]
    except ValueError:
        weights = []
    if not weights or any(not 0 <= w <= 100 for w in weights):
        raise typer.BadParameter("steps are weights within [0, 100], e.g. 10,50,100", param_hint="--steps")
    try:
        done = run_rollout(RouterClient(router, api_key, ca=ca), to, weights, parse_duration(hold), drain_old,
                           parse_duration(timeout), echo=typer.echo)
    except RolloutFailed as exc:
        typer.echo(f"rollout stopped: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"rollout to {done.new_pool} done in {done.to_json()['duration_s']:.1f} s")
    if as_json:
        typer.echo(json.dumps(done.to_json()))


@app.command()
@refusals
def recommend(profile: Path = typer.Option(..., "--profile", exists=True, dir_okay=False,
                                           help="speed profile JSON from `prfaas measure`"),
              link: str = typer.Option("10gbit", "--link", help="measured available bandwidth between datacenters"),
              routers: list[str] = typer.Option(["http://127.0.0.1:8000"], "--router", help="the router's URL; "
                                                "repeat it for each client cluster of a shared prefill pool"),
              api_key: str | None = API_KEY, ca: str | None = CA,
              signals: list[Path] = typer.Option([], "--signals", exists=True, dir_okay=False,
                                                 help="a saved /admin/signals JSON instead (repeatable)"),
              utilisation: float = typer.Option(0.7, "--utilisation", min=0.01, max=1.0,
                                                help="target load of each instance"),
              budget: str = typer.Option("500ms", "--local-prefill-budget", help="longest prefill left to decode"),
              as_json: bool = JSON) -> None:
    """Recommended prefill:decode instance counts and offload threshold from the router's live signals (a shared
    prefill pool: from the sum of its client clusters' signals, one --router or --signals per cluster)."""
    from prfaas.admin.recommend import combine, render
    from prfaas.admin.recommend import recommend as advise
    from prfaas.plan.profile import SpeedProfile
    from prfaas.units import parse_duration, parse_rate

    speeds, link_bps, budget_s = SpeedProfile.from_file(str(profile)), parse_rate(link), parse_duration(budget)
    clients = [_json_file(path) for path in signals] if signals else [
        RouterClient(router, api_key, ca=ca).get("/admin/signals") for router in routers]
    advice = advise(combine(clients), speeds, link_bps, target_utilisation=utilisation, local_prefill_budget_s=budget_s)
    typer.echo(render(advice))
    if as_json:
        typer.echo(json.dumps(advice.to_json()))


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdminError(f"cannot read {path}: {exc}") from None


@app.command()
@refusals
def links(router: str = ROUTER, api_key: str | None = API_KEY, ca: str | None = CA, as_json: bool = JSON) -> None:
    """Each (prefill datacenter, decode datacenter) link: bandwidth estimate, KV bytes routed and in flight,
    utilisation, TCP RTT and retransmissions, health (``GET /admin/links``)."""
    reply = RouterClient(router, api_key, ca=ca).get("/admin/links")
    for link in reply["links"]:
        health = f"degraded ({link['reason']})" if link["degraded"] else "healthy"
        typer.echo(f"{link['link']}: {link['bandwidth_bps'] / 1e9:.2f} Gbit/s estimated, "
                   f"{link['sent_bytes'] / 2**20:.1f} MiB routed, {link['inflight_bytes'] / 2**20:.1f} MiB in flight, "
                   f"utilisation {link['utilisation']:.0%}, RTT {link['rtt_ms']:.3f} ms, "
                   f"{link['retransmits']} retransmits, {health}")
    if not reply["links"]:
        typer.echo("no link has carried a request yet")
    if as_json:
        typer.echo(json.dumps(reply))
