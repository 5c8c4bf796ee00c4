"""``prfaas audit verify FILE...`` and ``prfaas audit report FILE... [--kv-id ID | --prefixes [--tenant T]]``:
check deletion/access logs and answer "was blob X deleted, when, why, and who accessed it" and "where are tenant
T's cached prefixes, and when and why were they deleted". ``--json`` prints one JSON object on the last line.
``verify`` exits 1 when any chain is broken."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import typer

from prfaas.audit.prefix import prefix_report
from prfaas.audit.report import blob_story, entries, summary
from prfaas.audit.verify import Verdict, verify

app = typer.Typer(help="Deletion proofs and access audit: verify hash-chained audit logs, answer questions.",
                  no_args_is_help=True)
FILES = typer.Argument(..., exists=True, dir_okay=False, help="audit log files (JSON lines)")
JSON = typer.Option(False, "--json", help="also print one JSON object on the last line")


@app.command("verify")
def verify_cmd(files: list[Path] = FILES, as_json: bool = JSON) -> None:
    """Check every hash link; print what each log records."""
    verdicts = [verify(f) for f in files]
    for v in verdicts:
        typer.echo(_verdict_text(v))
    if as_json:
        typer.echo(json.dumps({"ok": all(v.ok for v in verdicts), "logs": [v.to_dict() for v in verdicts]}))
    if not all(v.ok for v in verdicts):
        raise typer.Exit(1)


@app.command("report")
def report_cmd(files: list[Path] = FILES, kv_id: str = typer.Option("", "--kv-id", help="one blob's story"),
               prefixes: bool = typer.Option(False, "--prefixes", help="where each tenant's cached prefixes are, "
                                             "and their deletions (the instances' <instance>-prefix logs)"),
               tenant: str = typer.Option("", "--tenant", help="only this tenant's cached prefixes (implies "
                                          "--prefixes)"),
               as_json: bool = JSON) -> None:
    """Was blob X deleted, when and why, and who accessed it; where a tenant's cached prefixes live and when and
    why they were deleted; without ``--kv-id`` or ``--prefixes``, a summary of the logs."""
    found = entries(list(files))
    if prefixes or tenant:
        result = prefix_report(found, tenant)
        typer.echo(_prefix_text(result, tenant))
    else:
        result = blob_story(found, kv_id) if kv_id else summary(found)
        typer.echo(_story_text(result) if kv_id else _summary_text(result))
    if as_json:
        typer.echo(json.dumps(result))


def _when(ms: Any) -> str:
    if not isinstance(ms, int):
        return "-"
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _verdict_text(v: Verdict) -> str:
    status = "OK: the chain is intact" if v.ok else f"BROKEN: {v.error}"
    ended = ", ".join(f"{k} {n}" for k, n in sorted(v.ended.items())) or "none"
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(v.kinds.items()))
    return (f"{v.path}: {status}\n"
            f"  entries {v.entries} ({kinds}); head {v.head[:16]}…\n"
            f"  store sessions {v.sessions}, last one {'closed cleanly' if v.clean_close else 'not closed'}\n"
            f"  blobs: {v.created} created, {sum(v.ended.values())} ended ({ended}), {len(v.open_blobs)} with no "
            f"end recorded\n"
            f"  from {_when(v.first_ms)} to {_when(v.last_ms)}")


def _story_text(story: dict[str, Any]) -> str:
    if not story["known"]:
        return f"{story['kv_id']}: not in these logs"
    d = story["deletion"]
    head = (f"{story['kv_id']}: deleted {_when(d['deleted_ms'])}, reason {d['reason']}, {d['bytes']} bytes in "
            f"{d['chunks']} chunks, checksum {d['checksum']}, created {_when(d['created_ms'])}"
            + (f" ({d['detail']})" if d.get("detail") else "")) if d else f"{story['kv_id']}: NOT deleted"
    lines = [head, "  accesses:"]
    lines += [f"    {_when(a['at_ms'])} {a['action']:<8} by {a['who']} for {a['purpose'] or '-'}: {a['bytes']} "
              f"bytes, {a['outcome']}" for a in story["accesses"]]
    return "\n".join(lines)


def _summary_text(s: dict[str, Any]) -> str:
    reasons = ", ".join(f"{k} {n}" for k, n in sorted(s["ended_by_reason"].items())) or "none"
    life = s["lifetime_ms"]
    return "\n".join([
        f"blobs ended: {s['blobs_ended']} ({reasons}); with no end recorded: {len(s['never_ended'])}",
        f"accesses by action: {s['accesses_by_action']}",
        f"accesses by outcome: {s['accesses_by_outcome']}",
        f"accesses by who: {s['accesses_by_who']}",
        "blob lifetime: " + (f"p50 {life['p50']} ms, p99 {life['p99']} ms, max {life['max']} ms" if life else "-"),
    ])


def _prefix_text(report: dict[str, Any], tenant: str) -> str:
    if not report["tenants"]:
        return f"tenant {tenant}: no cached prefixes in these logs" if tenant else "no cached prefixes in these logs"
    lines = []
    for name, row in report["tenants"].items():
        lines.append(f"tenant {name or '(none)'}:")
        lines += [f"  cached on {instance} ({w['datacenter'] or 'unlabelled'}): {w['tokens']} tokens, {w['bytes']} "
                  f"bytes in {w['entries']} entries" for instance, w in row["live"].items()] or ["  cached nowhere"]
        lines += [f"  deleted {_when(d['at_ms'])} on {d['instance']} ({d['datacenter'] or 'unlabelled'}), "
                  f"{d['reason']}: {d['tokens']} tokens, {d['bytes']} bytes, stored {_when(d['created_ms'])}"
                  + (f" ({d['detail']})" if d.get("detail") else "") for d in row["deletions"]]
    return "\n".join(lines)
