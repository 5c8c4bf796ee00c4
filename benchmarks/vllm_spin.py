"""What vLLM's step-queue spin costs a P/D pair on shared cores: the same pair with vLLM's reader spin and with
prfaas's launcher default, one after the other in one run.

    .venv/bin/python benchmarks/vllm_spin.py [--requests 10] [--spins 1,0] [--out FILE.json]

vLLM's processes hand each step over a shared-memory queue whose reader spins (``sched_yield``) for
``busy_loop_s`` after every read; ``prfaas.vllm.launch`` sets it from ``PRFAAS_VLLM_SPIN_S`` (default 0 with the
CPU build; vLLM's own is 1 s). Per value in ``--spins``: a ``PrfaasConnector`` producer (direct mode) and
consumer (``tests/vllm/servers.py``: SmolLM2-135M fp32, eager, prefix caching off), then ``--requests`` times:
P with ``max_tokens: 1`` and ``do_remote_decode``, at once D with the params P returned (vLLM's toy-proxy flow),
streaming; recorded: D's TTFT, the CPU seconds P's processes used in the second after P's reply (from
``/proc``), then, after a pause, a whole local prefill on D right after another P request (D's TTFT). From D's
log: each pull's time, the retries (a chunk that did not come within ``kv_transfer_timeout_s``) and the loads
that failed (vLLM recomputed the prompt). Then
``--requests`` overlapped ones, as prfaas's router would dispatch them if decode went at once: P and D get the
request together, with a ``kv_id`` chosen up front, so D waits for the blob while P prefills (D retries a blob
not there yet for ``creation_grace_s``); recorded: P's reply time and D's TTFT, both from the start. Writes JSON
and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.provenance import provenance
from prfaas.kv.kvid import new_kv_id
from tests.services.deploy import descendants, free_port
from tests.vllm.servers import INSTALLED, MODEL, Server, start, stop, wait_healthy

PAUSE_S = 1.5  # between requests: longer than the spin of the request before
PROMPT_SENTENCES = 42  # about 590 tokens
MAX_TOKENS = 4
CREATION_GRACE_S = 30.0  # the overlapped D waits this long for P's blob
RECOMPUTED = "vLLM recomputes it"  # the connector's warning for a load that failed
PULLED = re.compile(r"pulled \S+ from \S+ \d+ bytes in ([\d.]+) ms")


def prompt(seed: int) -> str:
    base = 100 + (37 * seed) % 800
    return " ".join(f"The number {i} is followed by {i + 1}." for i in range(base, base + PROMPT_SENTENCES))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids``' threads so far."""
    ticks, hz = 0, os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / hz


def ttft_ms(server: Server, body: dict[str, Any]) -> float:
    """Milliseconds to the first streamed token of a completion on ``server``."""
    started = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {") and json.loads(line[len("data: "):]).get("choices"):
                return (time.perf_counter() - started) * 1e3
    raise RuntimeError(f"{server.url} streamed no token")


def p_reply_ms(p: Server, seed: int) -> float:
    """P's reply time alone (D idle), for the overlapped requests' comparison."""
    body = {"model": MODEL, "prompt": prompt(seed), "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    started = time.perf_counter()
    httpx.post(f"{p.url}/v1/completions", json=body, timeout=120).raise_for_status()
    elapsed = (time.perf_counter() - started) * 1e3
    time.sleep(PAUSE_S)
    return elapsed


def one_request(p: Server, d: Server, seed: int) -> dict[str, float]:
    body = {"model": MODEL, "prompt": prompt(seed), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    pids = [p.proc.pid, *descendants(p.proc.pid)]
    reply = httpx.post(f"{p.url}/v1/completions", timeout=120,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    reply.raise_for_status()
    before = cpu_seconds(pids)
    remote = ttft_ms(d, {**body, "kv_transfer_params": reply.json()["kv_transfer_params"]})
    time.sleep(max(0.0, 1.0 - remote / 1e3))
    p_cpu = cpu_seconds(pids) - before
    time.sleep(PAUSE_S)
    local_body = {**body, "prompt": prompt(seed + 1)}
    httpx.post(f"{p.url}/v1/completions", json=local_body, timeout=120).raise_for_status()
    local = ttft_ms(d, local_body)
    time.sleep(PAUSE_S)
    return {"ttft_ms": remote, "p_cpu_s_after_reply": p_cpu, "local_ttft_ms": local}


def overlapped(p: Server, d: Server, kv_address: str, seed: int) -> dict[str, float]:
    """P and D at once, D pulling the blob P is still computing: (P's reply, D's TTFT) in ms from the start."""
    body = {"model": MODEL, "prompt": prompt(seed), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    kv_id = new_kv_id("0" * 12)
    started = time.perf_counter()

    def prefill() -> float:
        httpx.post(f"{p.url}/v1/completions", timeout=120, json={**body, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "kv_id": kv_id}}).raise_for_status()
        return (time.perf_counter() - started) * 1e3

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(prefill)
        first = ttft_ms(d, {**body, "kv_transfer_params": {"do_remote_prefill": True, "kv_id": kv_id,
                                                           "kv_address": kv_address}})
        p_ms = reply.result()
    time.sleep(PAUSE_S)
    return {"p_reply_ms": p_ms, "ttft_ms": first}


def stage(model_dir: Path, spin: str, requests: int) -> dict[str, Any]:
    os.environ["PRFAAS_VLLM_SPIN_S"] = spin  # the servers' launcher reads it
    kv_address = f"127.0.0.1:{free_port()}"
    p = start(model_dir, "kv_producer", {"kv_address": kv_address})
    d = start(model_dir, "kv_consumer", {"creation_grace_s": CREATION_GRACE_S})
    try:
        wait_healthy([p, d])
        load = os.getloadavg()[0]
        samples = [one_request(p, d, 1000 * len(spin) + 2 * i) for i in range(requests)]
        sequential_log = d.text()
        sequential_p = [p_reply_ms(p, 1000 * len(spin) + 500 + i) for i in range(requests)]
        overlap = [overlapped(p, d, kv_address, 1000 * len(spin) + 700 + i) for i in range(requests)]
        log = d.text()
        later = log[len(sequential_log):]
        return {"spin_s": float(spin), "load_start": load, "load_end": os.getloadavg()[0], "samples": samples,
                "sequential_p_reply_ms": sequential_p, "overlapped": overlap,
                "pull_ms": [float(ms) for ms in PULLED.findall(sequential_log)],
                "pull_retries": sequential_log.count("; retry "),
                "recomputed": sequential_log.count(RECOMPUTED), "overlapped_recomputed": later.count(RECOMPUTED),
                "overlapped_pull_ms": [float(ms) for ms in PULLED.findall(later)]}
    finally:
        stop(p)
        stop(d)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    def med(values: list[float]) -> str:
        return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})" if values else "—"

    samples = result["samples"]
    return {"spin": f"{result['spin_s']:g} s", "ttft": med([s["ttft_ms"] for s in samples]),
            "pull": med(result["pull_ms"]), "retries": result["pull_retries"],
            "p_cpu": f"{statistics.median([s['p_cpu_s_after_reply'] for s in samples]):.2f}",
            "local": med([s["local_ttft_ms"] for s in samples]),
            "p_alone": med(result["sequential_p_reply_ms"]),
            "p_overlapped": med([o["p_reply_ms"] for o in result["overlapped"]]),
            "ttft_overlapped": med([o["ttft_ms"] for o in result["overlapped"]]),
            "recomputed": f"{result['recomputed']} / {result['overlapped_recomputed']}"}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| reader spin | D's TTFT, ms median (min–max) | pull, ms | pull retries | P's CPU-s in the second after "
            "its reply (median) | D's local TTFT, ms | P's reply alone, ms | overlapped: P's reply, ms | overlapped: "
            "TTFT, ms | recomputed (sequential / overlapped) |\n|---|---|---|---|---|---|---|---|---|---|\n")
    keys = ("spin", "ttft", "pull", "retries", "p_cpu", "local", "p_alone", "p_overlapped", "ttft_overlapped",
            "recomputed")
    return head + "".join("| " + " | ".join(str(r[k]) for k in keys) + " |\n" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--spins", default="1,0", help="PRFAAS_VLLM_SPIN_S values, in order")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vllm_spin.json")
    args = parser.parse_args()
    if not INSTALLED:
        raise SystemExit("vLLM's CPU build is not installed: run `make vllm`")
    from prfaas.engine import models

    model_dir = models.smollm2_dir()
    stages = [stage(model_dir, spin, args.requests) for spin in args.spins.split(",")]
    rows = [summary(s) for s in stages]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": provenance(), "stages": stages, "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
