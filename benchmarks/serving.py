"""TTFT through a deployment against the in-process engine's prefill, monolithic and remote, side by side in one run.

    .venv/bin/python benchmarks/serving.py [--model smollm2-135m] [--dtype auto] [--lengths 1024,2048,4096,8000]
                                           [--repeats 5] [--configs engine,monolithic] [--split-cores]
                                           [--out benchmarks/results/serving.json]

Each deployment is a real ``prfaas up`` driven through its OpenAI API with prompts of exact token lengths (token-id
prompts, streaming, ``max_tokens`` 16, greedy, one kept-alive connection per deployment; TTFT = the first chunk with
choices):
- ``monolithic``: offload threshold above every prompt, so the decode instance prefills locally (same router,
  same HTTP path, no KV transfer);
- ``relay`` / ``direct``: offload threshold 0, so every prompt is prefilled remotely and its KV crosses the
  data plane.
Beside them, in this process on a thread of its own (as an instance's engine thread) and with no HTTP at all:
``engine``, the prefill as one forward pass (``prefill_cache``, the floor), and ``engine chunked``, the prefill
cut into ``prefill_chunk_tokens`` passes exactly as a prfaas instance runs it (``prefill_chunks``), which isolates
what chunking itself costs.
All five run in one process tree at once and take turns prompt by prompt (the order rotating each repeat), so the
machine's load drift hits every configuration alike; while the engine rows run, the deployments sit idle, and the
CPU seconds they spend meanwhile are recorded (``idle_cpu_share``: what idle processes take from a prefill).
Every row gives the median TTFT with quartiles, min, max and every sample, and ``vs_engine_ms`` /
``vs_engine``: the median over the engine's median; the goal is within 5 % or 50 ms, whichever is larger.
``--dtype auto`` is prfaas's (bfloat16 where the CPU multiplies it natively, else float32).

``--split-cores`` gives the prefill side cores of its own, as a deployment that prefills in another datacenter has
(``prfaas.bench.cores``): every prefill instance and the engine rows' thread run on the first half of the cores,
everything else (decode instances, relays, routers, ``prfaas up`` and this process's clients) on the second, and every
process runs as many OpenMP threads as a half has cores. Without it every role shares all the cores, and a remote
prefill competes with its own KV's pull and restore on the decode side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.cores import CoreSplit
from prfaas.bench.fair import spread, tree_cpu_s
from prfaas.bench.provenance import provenance
from tests.services.deploy import deployment

MAX_TOKENS = 16
CHUNK_TOKENS = 512  # prefill_chunk_tokens' default (prfaas/config.py): what the deployments cut prefills into
GOAL_SHARE, GOAL_MS = 0.05, 50.0  # the serving path within 5 % or 50 ms of the engine, whichever is larger
Run = Callable[[list[int]], dict[str, Any]]
CONFIGS = ("engine", "engine chunked", "monolithic", "relay", "direct")


def one_request(client: httpx.Client, url: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed request on ``client``'s kept-alive connection, as a serving client sends it (a new client per
    request would time its own set-up too: about 20 ms here, most of it loading the CA bundle)."""
    body = {"model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    started, ttft, extension = time.perf_counter(), None, dict[str, Any]()
    with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - started
            extension = chunk.get("prfaas", extension)
    e2e = time.perf_counter() - started
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "route": extension.get("route"),
            "kv_bytes": extension.get("kv_bytes"), "stages": extension.get("stages", {})}


def prompts(length: int, repeats: int) -> list[list[int]]:
    rng = random.Random(length)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(repeats)]


def engine_runs(model: str, dtype: str, cores: CoreSplit | None) -> dict[str, Run]:
    """The in-process floor (one forward pass) and the same prefill chunked as an instance runs it."""
    import torch

    from prfaas.engine import load_engine

    if cores is not None:
        torch.set_num_threads(cores.threads)
    engine = load_engine(model, dtype=dtype)

    # The engine runs on a thread of its own, as an instance's engine thread does: with the cores oversubscribed, the
    # same prefill took 5-22 s on a process's main thread against 1.7-2.0 s on another thread (SmolLM2, 1,024
    # tokens, 2 cores at load 13), so a floor measured on the main thread would flatter every deployment.
    def pin() -> None:  # the engine thread on the prefill side's cores, where a deployment's prefill instance runs
        if cores is not None:
            os.sched_setaffinity(0, cores.engines)

    thread = ThreadPoolExecutor(1, thread_name_prefix="engine", initializer=pin)

    def timed(prefill: Callable[[list[int]], tuple[Any, int]]) -> Run:
        def work(prompt: list[int]) -> dict[str, Any]:
            started = time.perf_counter()
            cache, token = prefill(prompt)
            ttft = time.perf_counter() - started
            list(engine.stream(cache, token, len(prompt), MAX_TOKENS - 1))
            return {"ttft_s": ttft, "e2e_s": time.perf_counter() - started, "route": "in-process"}
        return lambda prompt: thread.submit(work, prompt).result()

    def whole(prompt: list[int]) -> tuple[Any, int]:
        cache, token, _ = engine.prefill_cache(prompt)
        return cache, token

    def chunked(prompt: list[int]) -> tuple[Any, int]:
        for step in engine.prefill_chunks(prompt, CHUNK_TOKENS):
            if step is not None:
                cache, token, _ = step
        return cache, token

    return {"engine": timed(whole), "engine chunked": timed(chunked)}


def bench(model: str, dtype: str, lengths: list[int], repeats: int, only: set[str], cores: CoreSplit | None,
          write: Callable[[list[dict[str, Any]], dict[str, Any]], None]) -> None:
    """Every configuration up at once, taking turns prompt by prompt; ``write`` gets the rows so far and the idle
    deployments' CPU use during the engine rows after each length (a run cut short keeps what it measured)."""
    configs = [(name, mode, threshold) for name, mode, threshold in (
        ("monolithic", "direct", max(lengths) + 1), ("relay", "relay", 0), ("direct", "direct", 0)) if name in only]
    with contextlib.ExitStack() as stack:
        ups = {name: stack.enter_context(deployment(model, mode, threshold=threshold, extra=("--dtype", dtype),
                                                    env=cores.env() if cores else None))
               for name, mode, threshold in configs}
        for _, proc in ups.values():
            if cores is not None:  # prefill instances on the engines' half
                cores.place(proc.pid, lambda command: "serve" in command and "prefill" in command)
        engines = engine_runs(model, dtype, cores)
        if cores is not None:  # this process's clients, once every deployment has started from all the cores
            os.sched_setaffinity(0, cores.rest)
        runs: dict[str, Run] = {**{k: v for k, v in engines.items() if k in only | {"engine"}},
                                **{name: _request(stack.enter_context(httpx.Client(timeout=600)), url)
                                   for name, (url, _) in ups.items()}}
        pids = [proc.pid for _, proc in ups.values()]
        for run in runs.values():  # warm-up of every code path, with ids no measured prompt uses
            run([40000 + i % 9000 for i in range(min(lengths))])
        samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
        idle = {"cpu_s": 0.0, "wall_s": 0.0}
        for n in lengths:
            for r, prompt in enumerate(prompts(n, repeats)):
                names = list(runs)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    spent, began = sum(tree_cpu_s(p) for p in pids), time.perf_counter()
                    samples.setdefault((name, n), []).append(runs[name](prompt))
                    if name.startswith("engine"):
                        idle["cpu_s"] += sum(tree_cpu_s(p) for p in pids) - spent
                        idle["wall_s"] += time.perf_counter() - began
            rows = [_summary(name, m, got, statistics.median(x["ttft_s"] for x in samples[("engine", m)]))
                    for (name, m), got in samples.items()]
            for row in rows[-len(runs):]:
                print(f"  {row['config']} {n}: TTFT {row['ttft_ms']:.0f} ms ({row['ttft_ms_q1']:.0f}–"
                      f"{row['ttft_ms_q3']:.0f}), {row['vs_engine']:+.1%} vs engine", flush=True)
            share = idle["cpu_s"] / idle["wall_s"] / (os.cpu_count() or 1) if idle["wall_s"] else None
            write(rows, {**idle, "idle_cpu_share": share, "lengths_done": sorted({m for _, m in samples})})


def _request(client: httpx.Client, url: str) -> Run:
    return lambda prompt: one_request(client, url, prompt)


def _summary(name: str, n: int, runs: list[dict[str, Any]], floor_s: float) -> dict[str, Any]:
    ttft, e2e = spread([r["ttft_s"] * 1e3 for r in runs]), spread([r["e2e_s"] * 1e3 for r in runs])
    allowed = max(GOAL_SHARE * floor_s * 1e3, GOAL_MS)
    over = (ttft["median"] or 0.0) - floor_s * 1e3
    return {"config": name, "prompt_tokens": n, "samples": ttft["n"], "ttft_ms": ttft["median"],
            "ttft_ms_q1": ttft["q1"], "ttft_ms_q3": ttft["q3"], "ttft_ms_min": ttft["min"], "ttft_ms_max": ttft["max"],
            "vs_engine_ms": over, "vs_engine": over / (floor_s * 1e3), "allowed_ms": allowed,
            "goal_met": over <= allowed, "e2e_ms": e2e["median"],
            "routes": sorted({str(r["route"]) for r in runs}), "kv_bytes": runs[0].get("kv_bytes"),
            "stages": runs[len(runs) // 2].get("stages", {}), "runs": runs, **overheads(runs)}


def overheads(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """What disaggregation adds, free of the prefill's own (noisy) compute time: TTFT minus the prefill's queue
    and compute time, and the transfer time not hidden behind the forward pass (median over runs)."""
    if not all("prefill_ms" in r.get("stages", {}) for r in runs):
        return {"beyond_prefill_ms": None, "exposed_transfer_ms": None}
    beyond = [r["ttft_s"] * 1e3 - r["stages"]["prefill_ms"] - r["stages"].get("queue_ms", 0.0) for r in runs]
    exposed = [r["stages"]["transfer_ms"] - r["stages"]["prefill_ms"] - r["stages"].get("queue_ms", 0.0)
               for r in runs if "transfer_ms" in r["stages"]]
    return {"beyond_prefill_ms": statistics.median(beyond),
            "exposed_transfer_ms": statistics.median(exposed) if exposed else None}


def print_table(rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"TTFT against the in-process engine (ms, median; {MAX_TOKENS} output tokens)")
    for col in ("prompt", "config", "route", "n", "TTFT", "IQR", "vs engine", "goal", "TTFT beyond prefill",
                "exposed transfer", "prefill", "E2E"):
        table.add_column(col, justify="right")
    for r in sorted(rows, key=lambda r: (r["prompt_tokens"], r["config"])):
        stages, extra = r["stages"], overheads(r["runs"])
        table.add_row(str(r["prompt_tokens"]), r["config"], ",".join(r["routes"]), str(r["samples"]),
                      f"{r['ttft_ms']:.0f}", f"{r['ttft_ms_q1']:.0f}–{r['ttft_ms_q3']:.0f}",
                      f"{r['vs_engine_ms']:+.0f} ({r['vs_engine']:+.1%})", "met" if r["goal_met"] else "missed",
                      *(f"{extra[k]:.0f}" if extra[k] is not None else "-"
                        for k in ("beyond_prefill_ms", "exposed_transfer_ms")),
                      f"{stages['prefill_ms']:.0f}" if "prefill_ms" in stages else "-", f"{r['e2e_ms']:.0f}")
    Console().print(table)


def main() -> None:
    # a SIGTERM (a timeout, a CI cancel) unwinds through the context managers, so no deployment is left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU runs it natively, else "
                        "float32; the same for the engine and every deployment")
    parser.add_argument("--lengths", default="1024,2048,4096,8000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="a subset of " + ",".join(CONFIGS)
                        + " (engine, the reference, always runs)")
    parser.add_argument("--split-cores", action="store_true", help="prefill instances and the engine rows on one "
                        "half of the cores, everything else on the other")
    parser.add_argument("--out", default="benchmarks/results/serving.json")
    parser.add_argument("--table", metavar="JSON", help="only print the table of an earlier run")
    args = parser.parse_args()
    if args.table:
        print_table(json.loads(Path(args.table).read_text())["rows"])
        return
    from prfaas.engine.loader import native_dtype

    dtype = native_dtype() if args.dtype == "auto" else args.dtype
    try:
        cores = CoreSplit.halves() if args.split_cores else None
    except ValueError as exc:
        parser.error(f"--split-cores: {exc}")
    out = Path(args.out)
    done: dict[str, Any] = {"rows": [], "idle": {}}
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(rows: list[dict[str, Any]], idle: dict[str, Any]) -> None:
        done.update(rows=rows, idle=idle)
        out.write_text(json.dumps({"provenance": provenance(), "model": args.model, "dtype_asked": args.dtype,
                                   "dtype": dtype, "repeats": args.repeats, "chunk_tokens": CHUNK_TOKENS,
                                   "split_cores": cores.json() if cores else None,
                                   "idle_deployments": idle, "rows": rows}, indent=2))

    bench(args.model, dtype, [int(x) for x in args.lengths.split(",")], args.repeats, set(args.configs.split(",")),
          cores, write)
    print_table(done["rows"])
    print(f"idle deployments took {done['idle'].get('idle_cpu_share') or 0:.1%} of the cores while the engine rows "
          "ran")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
