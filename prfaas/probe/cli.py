"""``prfaas probe serve --port P`` and ``prfaas probe run HOST:PORT [--json]``."""

from __future__ import annotations

import json

import typer

from prfaas.errors import InvalidRequest
from prfaas.units import parse_duration

app = typer.Typer(help="Measure a link: bandwidth, RTT, jitter, loss, path MTU.", no_args_is_help=True)


def _target(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"target must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@app.command("serve")
def serve(
    port: int = typer.Option(..., help="TCP and UDP port to listen on"),
    host: str = typer.Option("0.0.0.0", help="address to bind"),
    duration: str = typer.Option("0", help="stop after this long (e.g. 10m); 0 = until interrupted"),
) -> None:
    """Answer probes: TCP sink and echo, UDP echo, on one port."""
    from prfaas.probe.server import ProbeServer

    seconds = parse_duration(duration)
    server = ProbeServer(host, port, max_seconds=seconds or None).start()
    typer.echo(f"probe server on {host}:{server.port} (tcp+udp)", err=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()


@app.command("run")
def run(
    target: str = typer.Argument(..., help="HOST:PORT of a probe server"),
    streams: int = typer.Option(4, help="parallel TCP streams for bandwidth"),
    warmup: str = typer.Option("1s", help="warm-up before bytes are counted"),
    duration: str = typer.Option("5s", help="measured bulk-transfer time"),
    rtt_count: int = typer.Option(200, help="RTT samples"),
    udp_count: int = typer.Option(1000, help="UDP datagrams in the loss train"),
    udp_interval_ms: float = typer.Option(1.0, help="gap between UDP datagrams"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Measure the link to a probe server; the JSON feeds ``prfaas plan link --link``."""
    from prfaas.probe.client import ProbeConfig, check_reachable, run_probe
    from prfaas.probe.progress import probe_progress, render_result

    host, port = _target(target)
    if streams < 1 or rtt_count < 1 or udp_count < 1:
        raise InvalidRequest("--streams, --rtt-count and --udp-count must be at least 1")
    cfg = ProbeConfig(streams=streams, warmup_s=parse_duration(warmup), seconds=parse_duration(duration),
                      rtt_count=rtt_count, udp_count=udp_count, udp_interval_s=udp_interval_ms / 1e3)
    check_reachable(host, port, cfg)
    with probe_progress() as step:
        result = run_probe(host, port, cfg, step)
    if as_json:
        typer.echo(json.dumps(result.to_json()))
    else:
        render_result(result)
