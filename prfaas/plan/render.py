"""Readable rich tables for the plan commands (``--json`` prints the objects instead)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

MIB = float(1 << 20)


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def kv_table(out: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]{out['model']}[/] KV dtype {out['dtype']} (state {out['state_dtype']}), "
                  f"MLA {out['mla_layout']}, windows {out['window_mode']}; layers {out['layer_kinds']}")
    console.print(f"bytes/token {out['bytes_per_token']:,}  fixed {out['fixed_bytes']:,} B  "
                  f"windows full {out['window_bytes']:,} B")
    t = Table("seq_len", "KV bytes", "MiB", "KiB/token")
    for row in out["per_length"]:
        n, b = row["seq_len"], row["kv_bytes"]
        t.add_row(f"{n:,}", f"{b:,}", _mib(b), f"{b / n / 1024:,.1f}" if n else "-")
    console.print(t)
    kinds = Table("kind", "layers", "bytes/token", "fixed bytes", "window", "detail")
    seen: dict[tuple[Any, ...], list[int]] = {}
    for layer in out["layers"]:
        key = tuple(layer[k] for k in ("kind", "bytes_per_token", "fixed_bytes", "window", "detail"))
        seen.setdefault(key, []).append(layer["index"])
    for (kind, bpt, fixed, window, detail), idx in seen.items():
        kinds.add_row(kind, str(len(idx)), f"{bpt:,}", f"{fixed:,}", str(window or "-"), detail)
    console.print(kinds)


def link_table(out: dict[str, Any], console: Console) -> None:
    colour = {"feasible": "green", "marginal": "yellow"}.get(out["verdict"], "red")
    console.print(f"verdict: [bold {colour}]{out['verdict']}[/]")
    t = Table("rule", "ok", "value", "limit", "margin", "reason")
    for c in out["checks"]:
        value = "∞" if c["value"] is None else f"{c['value']:.4g} {c['unit']}"
        margin = "-∞" if c["margin"] is None else f"{c['margin']:+.4g}"
        t.add_row(c["rule"], "yes" if c["ok"] else "[red]NO[/]", value, f"{c['limit']:.4g} {c['unit']}",
                  margin, c["reason"])
    console.print(t)
    console.print(f"largest prompt that fits: {out['largest_prompt_tokens']:,} tokens")
    s = Table("setting", "value")
    for k, v in out["recommended"].items():
        s.add_row(k, str(v))
    console.print(s)
    for line in out["advice"]:
        console.print(f"- {line}")


def capacity_table(out: dict[str, Any], console: Console) -> None:
    t = Table("seq_len", "KV MiB", "prefill s", "Φ_kv Gbps", "instances per link")
    for r in out["phi_kv"]:
        per_link = r["instances_per_link"]
        t.add_row(f"{r['seq_len']:,}", _mib(r["kv_bytes"]), f"{r['prefill_seconds']:.3g}",
                  f"{r['phi_kv_gbps']:.2f}", f"{per_link:.1f}" if per_link is not None else "-")
    console.print(t)
    if not out.get("best"):
        return
    b = out["best"]
    console.print(f"best: offload prompts > {b['threshold']} tokens (p={b['p']:.3f}), local prefill:decode "
                  f"= {b['local_prefill']}:{b['decode']}, Λ_max = {b['lambda_max']:.4g} req/s, bound by "
                  f"{b['bound']}")
    th = Table("threshold", "p", "N_p:N_d", "Θ_prfaas", "Θ_local", "Θ_decode", "Λ_max", "bound")
    for p in out["thresholds"]:
        th.add_row(str(p["threshold"]), f"{p['p']:.3f}", f"{p['local_prefill']}:{p['decode']}",
                   *(f"{p[k]:.4g}" if p[k] is not None else "∞"
                     for k in ("theta_prfaas", "theta_local", "theta_decode", "lambda_max")), p["bound"])
    console.print(th)
