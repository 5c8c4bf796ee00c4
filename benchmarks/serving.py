"""TTFT and end-to-end latency: disaggregated (relay and direct) against monolithic, same model, same machine.

    .venv/bin/python benchmarks/serving.py [--model smollm2-135m] [--dtype bfloat16] [--lengths 256,1024,4096]
                                           [--repeats 3] [--out benchmarks/results/serving.json]

Each configuration is a real ``prfaas up`` deployment driven through its OpenAI API with prompts of exact token
lengths (token-id prompts, streaming, ``max_tokens`` 16, greedy):
- ``monolithic``: offload threshold above every prompt, so the decode instance prefills locally (same router,
  same HTTP path, no KV transfer);
- ``relay`` / ``direct``: offload threshold 0, so every prompt is prefilled remotely and its KV crosses the
  data plane.
Also ``engine``: prefill + decode inside this process (no HTTP at all), the floor. Medians of ``--repeats``.
The three deployments run side by side and requests alternate between them, so the machine's load drift hits
every configuration alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.provenance import provenance
from tests.services.deploy import deployment

MAX_TOKENS = 16


def one_request(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    started, ttft, extension = time.perf_counter(), None, {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - started
            extension = chunk.get("prfaas", extension)
    e2e = time.perf_counter() - started
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "route": extension.get("route"),
            "kv_bytes": extension.get("kv_bytes"), "stages": extension.get("stages", {})}


def prompts(length: int, repeats: int) -> list[list[int]]:
    rng = random.Random(length)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(repeats)]


def bench_deployments(configs: list[tuple[str, str, int]], model: str, dtype: str, lengths: list[int],
                      repeats: int) -> list[dict[str, Any]]:
    """All deployments run side by side; requests alternate between them, so load drift hits all alike."""
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(deployment(model, mode, threshold=threshold,
                                                     extra=("--dtype", dtype)))[0]
                for name, mode, threshold in configs}
        for url in urls.values():
            one_request(url, prompts(32, 1)[0])  # warm-up
        rows = []
        for n in lengths:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
            for prompt in prompts(n, repeats):
                for name, url in urls.items():
                    runs[name].append(one_request(url, prompt))
            for name in urls:
                rows.append(_summary(name, n, runs[name]))
                print(f"  {name} {n}: TTFT {rows[-1]['ttft_ms']:.0f} ms", flush=True)
    return rows


def bench_engine(model: str, dtype: str, lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    from prfaas.engine import load_engine

    engine = load_engine(model, dtype=dtype)
    engine.prefill([1, 2, 3])
    rows = []
    for n in lengths:
        runs = []
        for p in prompts(n, repeats):
            started = time.perf_counter()
            cache, token, _ = engine.prefill_cache(p)
            ttft = time.perf_counter() - started
            list(engine.stream(cache, token, n, MAX_TOKENS - 1))
            runs.append({"ttft_s": ttft, "e2e_s": time.perf_counter() - started, "route": "in-process"})
        rows.append(_summary("engine", n, runs))
    return rows


def _summary(name: str, n: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs) * 1e3

    return {"config": name, "prompt_tokens": n, "ttft_ms": med("ttft_s"), "e2e_ms": med("e2e_s"),
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
    table = Table(title=f"TTFT and end-to-end latency (ms, median; {MAX_TOKENS} output tokens)")
    for col in ("prompt", "config", "route", "TTFT", "E2E", "TTFT beyond prefill", "exposed transfer", "KV MiB",
                "prefill", "transfer", "restore"):
        table.add_column(col, justify="right")
    for r in sorted(rows, key=lambda r: (r["prompt_tokens"], r["config"])):
        stages, extra = r["stages"], overheads(r["runs"])
        table.add_row(str(r["prompt_tokens"]), r["config"], ",".join(r["routes"]), f"{r['ttft_ms']:.0f}",
                      f"{r['e2e_ms']:.0f}", *(f"{extra[k]:.0f}" if extra[k] is not None else "-"
                                             for k in ("beyond_prefill_ms", "exposed_transfer_ms")),
                      f"{r['kv_bytes'] / 2**20:.1f}" if r["kv_bytes"] else "-",
                      *(f"{stages[k]:.0f}" if k in stages else "-"
                        for k in ("prefill_ms", "transfer_ms", "restore_ms")))
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/serving.json")
    parser.add_argument("--table", metavar="JSON", help="only print the table of an earlier run")
    args = parser.parse_args()
    if args.table:
        print_table(json.loads(Path(args.table).read_text())["rows"])
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = bench_engine(args.model, args.dtype, lengths, args.repeats)
    big = max(lengths) + 1
    configs = [("monolithic", "direct", big), ("relay", "relay", 0), ("direct", "direct", 0)]
    rows += bench_deployments(configs, args.model, args.dtype, lengths, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"provenance": provenance(), "model": args.model, "dtype": args.dtype,
                                          "rows": rows}, indent=2))
    print_table(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
