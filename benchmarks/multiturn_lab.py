"""A multi-turn chat through the lab's WAN, with and without the prefix cache, relay and direct mode, real models.

    .venv/bin/python benchmarks/multiturn_lab.py [--quick] [--models smollm2-135m,tiny-qwen3-next]
        [--modes relay,direct] [--conversations 4] [--turns 6] [--cache-mb 512] [--rate 1gbit] [--delay-ms 0]

Builds a two-datacenter lab (``Topology.numbered(--lab-index)``, so it runs beside ``prfaas lab``'s default one;
one WAN link, ``--rate`` with ``--delay-ms`` of one-way delay: the lab's default is no added delay, so the RTT is
the veth's), then for every model × mode × cache setting runs ``prfaas up --lab --lab-index`` (prefill in the
prefill datacenter; router, relay and decode in the decode datacenter) with ``prefix_cache_mb`` = ``--cache-mb``
on prefill and decode instances, or 0, and ``--offload-threshold 0``: every turn goes remote, so its KV crosses
the link.

Each conversation starts with one shared system prompt (``--system`` random token ids); every turn sends the whole
history plus a new user message (``--user`` ids), greedy, ``--answer`` tokens; the answer's text, encoded with the
model's tokenizer, joins the history before the next user message. Turns go one request at a time, turn-major
(every conversation's turn 1, then every turn 2, …), so the cache holds all conversations at once and each
request's counters are its own. Per request: client TTFT (first streamed token), the router's TTFT and stages,
the KV bytes the response reports, the bytes the WAN veth carried (dc-a's end, both directions, counted by the
kernel: KV plus control traffic and heartbeats; the idle rate is measured and recorded), and the prompt tokens
the prefill instance computed (prompt tokens less ``prfaas_prefix_cache_saved_tokens_total`` of its metrics).
Rows aggregate a turn over the conversations; ``goals`` compares each turn from the third on against the run
without the cache. Writes ``benchmarks/results/multiturn_lab.json`` (rewritten after every deployment, so a run
cut short keeps what it measured) and prints a table. Needs root; refuses when its numbered lab is up. The CPUs
are shared with every role and whatever else runs here: the load average is recorded before and after each
deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from prfaas.bench.background import start_up, stop_up
from prfaas.bench.client import request_body
from prfaas.bench.fair import prfaas_dtypes
from prfaas.bench.provenance import provenance
from prfaas.bench.stats import percentile
from prfaas.lab import Lab, LinkSettings, Topology
from prfaas.lab.system import namespaces, run

LAB_INDEX = 16  # Topology.numbered: clear of the tests' (7-9) and the other lab benchmarks' (5, 10, 11, 13)
ROUTER_PORT = 8430
UP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0
IDLE_S = 5.0  # how long the link's idle traffic (heartbeats) is counted before each deployment's run
QUICK = {"models": "tiny-qwen3-next", "modes": "relay", "conversations": 2, "turns": 3, "system": 64, "user": 16,
         "answer": 4}


@dataclass(frozen=True)
class Cell:
    """One deployment: a model in a mode with a cache budget (0: no cache)."""

    model: str
    mode: str
    cache_mb: int


@dataclass
class Conversation:
    prompt: list[int]
    seed: int
    sent: int = 0  # the previous turn's prompt length: what the new turn extends


def ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def tokenizer() -> Any:
    """SmolLM2's tokenizer, which every built-in model shares (prfaas.engine.models)."""
    from tokenizers import Tokenizer

    from prfaas.engine import models

    return Tokenizer.from_file(str(models.smollm2_dir() / "tokenizer.json"))


def wan_bytes(topo: Topology) -> int:
    """Bytes the WAN link has carried so far, both directions, at dc-a's end (the kernel's counters)."""
    stats = f"/sys/class/net/{topo.wan_if}/statistics"
    rx, tx = run(["cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"], ns=topo.ns_a).split()
    return int(rx) + int(tx)


def saved_tokens(url: str, ns: str) -> float:
    """``prfaas_prefix_cache_saved_tokens_total`` of the instance at ``url`` (0 without a cache), read from
    inside its datacenter (the root namespace has no route to dc-a)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = run(["curl", "-sf", "--max-time", "30", f"{url}/metrics"], ns=ns)
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "prfaas_prefix_cache_saved_tokens_total")


class Deployment:
    """``prfaas up --lab`` for one cell; its stdout (every role's log) drained by a thread once it is up."""

    def __init__(self, cell: Cell, args: argparse.Namespace, workdir: Path) -> None:
        config = workdir / f"config-{cell.cache_mb}.yaml"
        config.write_text(f"prefix_cache_mb: {cell.cache_mb}\n")
        self.topo = Topology.numbered(args.lab_index)
        self.url = f"http://{self.topo.public_b}:{ROUTER_PORT}"
        self.proc = start_up(["--lab", "--model", cell.model, "--mode", cell.mode, "--dtype", args.dtype,
                              "--lab-index", str(args.lab_index), "--port", str(ROUTER_PORT), "--offload-threshold",
                              "0", "--config", str(config)], workdir / "up.log", UP_TIMEOUT_S)

    def instance(self, role: str) -> tuple[str, str]:
        """(url, namespace) of the deployment's one instance of ``role``."""
        infos = httpx.get(f"{self.url}/admin/instances", timeout=30).json()
        url = next(str(i["url"]) for i in infos if i["role"] == role)
        return url, self.topo.ns_a if role == "prefill" else self.topo.ns_b

    def dtypes(self) -> list[str]:
        return prfaas_dtypes(httpx.get(f"{self.url}/admin/pools", timeout=30).json())

    def stop(self) -> None:
        stop_up(self.proc)


@dataclass
class Turn:
    """One streamed completion as the client saw it."""

    ttft_ms: float | None = None
    text: str = ""
    prfaas: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], answer: int) -> Turn:
    """A greedy streamed completion of exactly ``answer`` tokens: TTFT at the first chunk with choices, the text,
    and the ``prfaas`` field of the last event. A failure is returned in ``error``, never raised."""
    turn, started = Turn(), time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=request_body("", prompt, answer),
                                 timeout=REQUEST_TIMEOUT_S) as reply:
            if reply.status_code != 200:
                turn.error = f"HTTP_{reply.status_code}: {(await reply.aread())[:200]!r}"
                return turn
            async for line in reply.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _take(turn, json.loads(line[6:]), started)
    except httpx.HTTPError as exc:
        turn.error = f"{type(exc).__name__}: {exc}"[:200]
    if turn.ttft_ms is None and turn.error is None:
        turn.error = "NO_TOKENS"
    return turn


def _take(turn: Turn, event: dict[str, Any], started: float) -> None:
    if "error" in event:
        turn.error = str(event["error"].get("code") or event["error"])
    if event.get("choices"):
        if turn.ttft_ms is None:
            turn.ttft_ms = (time.perf_counter() - started) * 1e3
        turn.text += event["choices"][0].get("text") or ""
    if "prfaas" in event:
        turn.prfaas = event["prfaas"]


async def one_turn(client: httpx.AsyncClient, dep: Deployment, prompt: list[int], answer: int,
                   prefill: tuple[str, str]) -> tuple[Turn, dict[str, int]]:
    """One request, alone on the deployment: what the client saw, and what the link and the prefill instance
    counted meanwhile."""
    saved, wan = saved_tokens(*prefill), wan_bytes(dep.topo)
    turn = await stream(client, dep.url, prompt, answer)
    wan_after, saved_after = wan_bytes(dep.topo), saved_tokens(*prefill)
    return turn, {"wan_bytes": wan_after - wan, "computed_tokens": len(prompt) - int(saved_after - saved)}


async def chat(dep: Deployment, args: argparse.Namespace, tok: Any) -> list[dict[str, Any]]:
    """Every conversation's turns, turn-major, after one warm-up request that shares no prefix; one dict per
    request."""
    vocab = tok.get_vocab_size()
    convs = [Conversation(ids(args.system, 7, vocab), seed) for seed in range(args.conversations)]
    prefill, out = dep.instance("prefill"), []
    async with httpx.AsyncClient() as client:
        await stream(client, dep.url, ids(args.system + args.user, 99, vocab), args.answer)
        for turn in range(1, args.turns + 1):
            for conv in convs:
                prompt = conv.prompt + ids(args.user, conv.seed * 1000 + turn, vocab)
                seen, counted = await one_turn(client, dep, prompt, args.answer, prefill)
                out.append({"turn": turn, "conversation": conv.seed, "prompt_tokens": len(prompt),
                            "new_tokens": len(prompt) - conv.sent, **counted, **_of(seen)})
                conv.sent, conv.prompt = len(prompt), prompt + tok.encode(seen.text, add_special_tokens=False).ids
    return out


def _of(turn: Turn) -> dict[str, Any]:
    meta, stages = turn.prfaas, turn.prfaas.get("stages") or {}
    return {"error": turn.error, "route": meta.get("route"), "reason": meta.get("reason_code"), "text": turn.text,
            "ttft_ms": turn.ttft_ms, "router_ttft_ms": meta.get("ttft_ms"), "kv_bytes": int(meta.get("kv_bytes") or 0),
            "prefill_ms": stages.get("prefill_ms"), "transfer_ms": stages.get("transfer_ms"),
            "restore_ms": stages.get("restore_ms")}


def run_cell(cell: Cell, args: argparse.Namespace, tok: Any, workdir: Path) -> tuple[list[dict[str, Any]],
                                                                                     dict[str, Any]]:
    """One deployment, up, idle-counted, chatted with and stopped: its requests and what it was."""
    began, load_before = time.perf_counter(), os.getloadavg()
    dep = Deployment(cell, args, workdir)
    try:
        up_s, idle = time.perf_counter() - began, wan_bytes(dep.topo)
        time.sleep(IDLE_S)
        idle_bps = (wan_bytes(dep.topo) - idle) / IDLE_S
        dtypes, load_run = dep.dtypes(), os.getloadavg()
        requests = asyncio.run(chat(dep, args, tok))
    finally:
        dep.stop()
    info = {"model": cell.model, "mode": cell.mode, "cache_mb": cell.cache_mb, "dtype": dtypes,
            "up_s": round(up_s, 1), "wall_s": round(time.perf_counter() - began, 1),
            "idle_wan_bytes_per_s": round(idle_bps), "loadavg_before_up": list(load_before),
            "loadavg_before_run": list(load_run), "loadavg_after": list(os.getloadavg())}
    return [{"model": cell.model, "mode": cell.mode, "cache_mb": cell.cache_mb, **r} for r in requests], info


def _median(values: list[Any]) -> Any:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def _ms(values: list[Any], q: float) -> float | None:
    found = percentile([float(v) for v in values if v is not None], q)
    return None if found is None else round(found, 1)


def rows(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model, mode, cache setting and turn: medians and TTFT percentiles over the conversations."""
    groups: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for r in requests:
        groups.setdefault((r["model"], r["mode"], r["cache_mb"], r["turn"]), []).append(r)
    answers = {(r["model"], r["mode"], r["cache_mb"], r["turn"], r["conversation"]): r["text"] for r in requests}
    out = []
    for (model, mode, cache_mb, turn), group in groups.items():
        ok = [r for r in group if r["error"] is None]
        remote = [r for r in ok if r["route"] == "remote"]
        other = [answers.get((model, mode, 0 if cache_mb else -1, turn, r["conversation"])) for r in group]
        out.append({"model": model, "mode": mode, "cache_mb": cache_mb, "turn": turn, "requests": len(group),
                    "failed": len(group) - len(ok), "remote": len(remote), "local": len(ok) - len(remote),
                    **{k: _median([r[k] for r in ok]) for k in ("prompt_tokens", "new_tokens", "kv_bytes",
                                                                 "wan_bytes")},
                    "computed_tokens": _median([r["computed_tokens"] for r in remote]),
                    "ttft_p50_ms": _ms([r["ttft_ms"] for r in ok], 50),
                    "ttft_p99_ms": _ms([r["ttft_ms"] for r in ok], 99),
                    "router_ttft_p50_ms": _ms([r["router_ttft_ms"] for r in ok], 50),
                    "prefill_p50_ms": _ms([r["prefill_ms"] for r in ok], 50),
                    "transfer_p50_ms": _ms([r["transfer_ms"] for r in ok], 50),
                    "answers_equal": None if not cache_mb or None in other else
                    [r["text"] for r in group] == other})
    return out


def goals(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """From the third turn on, each cached turn against the same turn without the cache (TTFT P50 at least 2×
    lower) and against the cached second turn: WAN bytes (and, apart from control traffic and heartbeats, the KV
    bytes the responses report) grew with the new tokens when their growth since the second turn is closer to the
    new tokens' growth than to the prompt's (the history's)."""
    by = {(r["model"], r["mode"], r["cache_mb"] > 0, r["turn"]): r for r in table}
    out = []
    for (model, mode, cached, turn), row in by.items():
        plain, base = by.get((model, mode, False, turn)), by.get((model, mode, True, 2))
        if not cached or turn < 3 or plain is None or base is None:
            continue
        speedup = _ratio(plain["ttft_p50_ms"], row["ttft_p50_ms"])
        growth = {k: _ratio(row[k], base[k]) for k in ("wan_bytes", "kv_bytes", "new_tokens", "prompt_tokens")}
        out.append({"model": model, "mode": mode, "turn": turn, "prompt_tokens": row["prompt_tokens"],
                    "new_tokens": row["new_tokens"], "ttft_p50_ms": row["ttft_p50_ms"],
                    "ttft_p50_ms_without": plain["ttft_p50_ms"], "ttft_speedup": speedup,
                    "ttft_goal_met": None if speedup is None else speedup >= 2.0,
                    "wan_bytes": row["wan_bytes"], "wan_bytes_without": plain["wan_bytes"],
                    "wan_bytes_per_new_token": _ratio(row["wan_bytes"], row["new_tokens"]),
                    **{f"{k.split('_')[0]}_vs_turn2": v for k, v in growth.items()},
                    "wan_goal_met": _closer_to_new(growth, "wan_bytes"),
                    "kv_goal_met": _closer_to_new(growth, "kv_bytes")})
    return out


def _closer_to_new(growth: dict[str, float | None], key: str) -> bool | None:
    """Whether bytes (``key``) grew since the second turn closer to the new tokens than to the prompt."""
    grew, new, prompt = growth[key], growth["new_tokens"], growth["prompt_tokens"]
    if grew is None or new is None or prompt is None:
        return None
    return abs(grew - new) < abs(grew - prompt)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def code_state() -> dict[str, Any]:
    """The commit the run started on and the files changed beside it: every deployment imports the working tree
    as it is when it starts."""
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                              text=True, timeout=30)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "changed": git("status", "--porcelain").splitlines()}


NOTES = ["every turn is asked to go remote (threshold 0), so its KV crosses the lab link; the router may still "
         "keep one local (remote/local per row), e.g. on a degraded link",
         "wan_bytes: both directions of the WAN veth at dc-a's end during the request (KV, control traffic, "
         "heartbeats); idle_wan_bytes_per_s in runs is the link's traffic with no request",
         "computed_tokens: of the remote turns, prompt tokens less the prefill instance's prefix-cache saved tokens",
         "goals: from turn 3 on, cached against uncached at the same turn (ttft_speedup) and against the cached "
         "second turn (wan_vs_turn2, and kv_vs_turn2, closer to new_vs_turn2 than to prompt_vs_turn2)",
         "the CPUs are shared by every role, the delay line and other work: see the load averages"]


def report_of(args: argparse.Namespace, link: LinkSettings, runs: list[dict[str, Any]],
              requests: list[dict[str, Any]], code: dict[str, Any]) -> dict[str, Any]:
    table = rows(requests)
    return {"provenance": provenance(), "code": code,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "link": {"rate": link.rate, "delay_ms": link.delay_ms, "rtt_asked_ms": 2 * link.delay_ms},
            "offload_threshold": 0, "runs": runs, "rows": table, "goals": goals(table), "requests": requests,
            "notes": NOTES}


def print_table(table: list[dict[str, Any]]) -> None:
    print(f"{'model':<16} {'mode':<6} {'cache':>5} {'turn':>4} {'prompt':>6} {'new':>4} {'computed':>8} "
          f"{'KV MiB':>7} {'WAN MiB':>7} {'TTFT p50':>8} {'p99':>8} equal")
    for r in table:
        mib = [None if r[k] is None else round(r[k] / 2**20, 2) for k in ("kv_bytes", "wan_bytes")]
        print(f"{r['model']:<16} {r['mode']:<6} {r['cache_mb']:>5} {r['turn']:>4} {r['prompt_tokens']!s:>6} "
              f"{r['new_tokens']!s:>4} {r['computed_tokens']!s:>8} {mib[0]!s:>7} {mib[1]!s:>7} "
              f"{r['ttft_p50_ms']!s:>8} {r['ttft_p99_ms']!s:>8} {r['answers_equal']}")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a small run: {QUICK}")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "multiturn_lab.json"))
    parser.add_argument("--models", default="smollm2-135m,tiny-qwen3-next")
    parser.add_argument("--modes", default="relay,direct")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=256, help="shared system prompt, tokens")
    parser.add_argument("--user", type=int, default=32, help="tokens of each new user message")
    parser.add_argument("--answer", type=int, default=16, help="tokens of each answer")
    parser.add_argument("--cache-mb", type=int, default=512, help="prefix_cache_mb of the cached runs")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added on the link")
    parser.add_argument("--lab-index", type=int, default=LAB_INDEX, help="the numbered lab to build and use")
    parser.add_argument("--rederive", action="store_true", help="measure nothing: recompute the rows and goals of "
                        "--out from the requests it holds (after a change to how they are derived)")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def rederive(path: Path) -> None:
    """Rows and goals of a results file recomputed from its per-request records; everything else kept."""
    report = json.loads(path.read_text())
    report["rows"] = rows(report["requests"])
    report["goals"] = goals(report["rows"])
    report["notes"] = NOTES
    path.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report["rows"])


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: the deployment stops and the lab comes down


def main() -> None:
    args = parse()
    signal.signal(signal.SIGTERM, _interrupt)
    if args.rederive:
        return rederive(Path(args.out))
    topo = Topology.numbered(args.lab_index)
    if any(ns in namespaces() for ns in topo.namespaces):
        raise SystemExit(f"lab {args.lab_index} is up ({', '.join(topo.namespaces)}): another run is using it")
    cells = [Cell(m, mode, mb) for m in args.models.split(",") for mode in args.modes.split(",")
             for mb in (args.cache_mb, 0)]
    tok, link, code = tokenizer(), LinkSettings(rate=args.rate, delay_ms=args.delay_ms), code_state()
    runs: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="prfaas-multiturn-") as work, Lab(link, topo):
        for cell in cells:
            done, info = run_cell(cell, args, tok, Path(work))
            requests, runs = requests + done, [*runs, info]
            print(f"{cell}: up {info['up_s']} s, {len(done)} requests, load {info['loadavg_before_run']}",
                  flush=True)
            Path(args.out).write_text(json.dumps(report_of(args, link, runs, requests, code), indent=1) + "\n")
    print_table(rows(requests))


if __name__ == "__main__":
    main()
