"""``prfaas admin usage`` (the daily metering report from audit logs) and ``prfaas admin store-key`` (a master key
for encryption at rest). Registered under ``prfaas admin`` by ``prfaas.cli``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from prfaas.audit.report import entries
from prfaas.tenancy import metering


def usage(logs: list[Path] = typer.Argument(..., help="audit logs: the router's (requests), every store's and "
                                            "each prefill instance's pool usage log", exists=True, dir_okay=False),
          day: str = typer.Option(None, "--day", help="UTC day YYYY-MM-DD (default: today); 'all' for everything"),
          out: Path = typer.Option(None, "--out", help="also write the report to this JSON file"),
          as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line")) -> None:
    """Per-tenant usage for one day: requests, tokens, KV bytes across the WAN and byte-seconds held, per
    datacenter pair, and the offload fraction; per client cluster of a shared prefill pool: prefills, prompt
    tokens, prefill seconds, KV bytes per link and refusals over quota (from the prefill instances' usage logs);
    summed from the audit logs (check them with `prfaas audit verify`)."""
    chosen = None if day == "all" else day or metering.today()
    report = metering.usage_report(entries(list(logs)), chosen)
    text = json.dumps(report, sort_keys=True)
    if out:
        out.write_text(text + "\n")
    if as_json:
        typer.echo(text)
        return
    typer.echo(f"usage for {chosen or 'all days'}")
    for tenant, row in report["tenants"].items():
        t = row["total"]
        typer.echo(f"  {tenant or '(none)'}: {t['requests']} requests ({t['offload_fraction']:.0%} remote), "
                   f"{t['prompt_tokens']} prompt + {t['output_tokens']} output tokens, {t['kv_wan_bytes']} KV bytes "
                   f"across the WAN, {t['kv_byte_seconds']:.0f} KV byte-seconds held")
        for pair, p in row["pairs"].items():
            typer.echo(f"    {pair}: {p['requests']} requests, {p['kv_wan_bytes']} WAN bytes")
    for cluster, c in report["clusters"].items():
        links = ", ".join(f"{link} {n}" for link, n in c["kv_bytes"].items()) or "none"
        typer.echo(f"  cluster {cluster}: {c['prefills']} prefills, {c['prompt_tokens']} prompt tokens, "
                   f"{c['prefill_seconds']:.3f} prefill seconds, KV bytes per link: {links}; "
                   f"{c['refused_over_quota']} refused over quota, {c['failed']} failed")


def store_key(path: Path = typer.Argument(..., help="where to write the key (mode 0600; never overwritten)")) -> None:
    """Create a master key for encryption at rest; point `store_key_file` at it (or export its content as
    $PRFAAS_STORE_KEY) on relays and direct-mode prefill instances."""
    from prfaas.store.sealed import new_master_key

    new_master_key(str(path))
    typer.echo(f"wrote a new store master key to {path}")
