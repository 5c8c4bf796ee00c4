"""``make demo``: a whole deployment on this machine, one short chat that stays local and one long chat that goes
to remote prefill, in relay mode and in direct mode; each answer with its route, KV bytes, transfer time, TTFT."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from prfaas import terminal
from prfaas.services.up import Deployment, UpOptions

SHORT = "What is the capital of France? Answer in one sentence."
LONG = ("Read this note and answer the question after it.\n\n"
        "Prefill-as-a-Service runs the prompt (prefill) in one datacenter with dense compute, and token "
        "generation (decode) in another datacenter close to the users. The KV cache made by prefill is "
        "serialized into a checksummed blob, sent over ordinary Ethernet in chunks while later layers are "
        "still being computed, verified, restored into the decoding model and released. Short prompts are "
        "cheaper to prefill locally, so only prompts longer than an offload threshold go to the remote pool. "
        "Hybrid models with linear-attention layers make the KV cache small enough for this to pay off.\n\n"
        "Question: what is sent over Ethernet between the two datacenters?")


def run_full_demo(model: str, port: int, threshold: int, max_tokens: int) -> None:
    console = terminal.console()
    for mode in ("relay", "direct"):
        console.rule(f"[bold]prfaas up --model {model} --mode {mode} --offload-threshold {threshold}")
        log = Path(tempfile.gettempdir()) / f"prfaas-demo-{mode}.log"
        deployment = Deployment(UpOptions(model=model, mode=mode, port=port, offload_threshold=threshold,
                                          log_file=str(log)))
        try:
            with console.status("starting router, relay, prefill and decode processes"):
                started = time.perf_counter()
                deployment.start()
                deployment.wait_ready()
            console.print(f"healthy at {deployment.url} after {time.perf_counter() - started:.1f} s; "
                          f"processes {', '.join(str(c.pid) for c in deployment.children)}; logs in {log}")
            rows = [_ask(deployment.url, content, max_tokens, console) for content in (SHORT, LONG)]
            console.print(_table(mode, rows))
        finally:
            deployment.stop()
        console.print("stopped: every process exited\n")
    console.print("[bold]local[/] = prefilled on the decode instance; [bold]remote[/] = prefilled by the prefill "
                  "instance (datacenter A), KV shipped to decode (datacenter B) "
                  "through the relay (relay mode) or straight from prefill's own store (direct mode).")


def _ask(url: str, content: str, max_tokens: int, console: Console) -> dict[str, Any]:
    body = {"model": "", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
    extension = reply["prfaas"]
    console.print(f"[bold]user[/] ({reply['usage']['prompt_tokens']} tokens): {content[:90]}"
                  f"{'…' if len(content) > 90 else ''}")
    console.print(f"[bold]assistant[/] ({extension['route']}): {reply['choices'][0]['message']['content']}\n")
    return {"tokens": reply["usage"]["prompt_tokens"], **extension}


def _table(mode: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{mode} mode (times in ms; transfer runs while prefill computes)")
    for column in ("prompt tokens", "route", "KV bytes", "prefill", "transfer", "restore", "TTFT"):
        table.add_column(column, justify="right")
    for r in rows:
        stages = r.get("stages", {})
        kv = f"{r['kv_bytes'] / 2**20:.2f} MiB" if r.get("kv_bytes") else "-"
        table.add_row(str(r["tokens"]), r["route"], kv, *(_ms(stages.get(k)) for k in
                      ("prefill_ms", "transfer_ms", "restore_ms")), _ms(r["ttft_ms"]))
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
