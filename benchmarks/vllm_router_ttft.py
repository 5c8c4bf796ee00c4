"""TTFT through prfaas's router with vLLM as the engine, against vLLM alone, in one run.

    .venv/bin/python benchmarks/vllm_router_ttft.py [--samples 8] [--mode direct] [--out FILE.json]

Stages, one after the other (a vLLM server here takes about 4 GB):
1. ``prfaas up --engine vllm --model smollm2-135m --dtype float32 --offload-threshold 0``: every prompt remote.
   Each sample is two requests, alternating: as a client sends it (the decode instance streams prefill's first
   token at once: ``remote``), and the same with a stop string that never occurs, which keeps decode's vLLM
   computing the first token again after the pull, as before prfaas passed it on (``remote_recompute_first``;
   the same text).
2. The same deployment with its prefill instance drained (``/admin/drain/prefill-0``): every prompt local, the
   decode's vLLM prefilling it (``local``).
3. vLLM alone (``tests/vllm/servers.py``, the instance's flags): without a KV connector (``vllm``), and with
   ``PrfaasConnector`` loaded as a consumer that is never sent a blob (``vllm_with_connector``): on this machine
   the first is much slower (about 870 against 460 ms for these prompts, cause not found), so the goal is taken
   against the faster of the two.
Every request: a distinct prompt of about 460 tokens (prefix caching is off everywhere), greedy, streaming,
``max_tokens`` 4, one at a time with a pause between; TTFT is the client's, from sending to the first chunk with
text. Reports median, min–max and quartiles per stage, the router's ``prfaas`` stages for the remote ones, and the
goal (TTFT overhead over vLLM alone within max(5 %, 1 RTT + 10 ms); RTT here is loopback, taken as 0). Writes JSON
with the machine's provenance (CPU model, ISA flags, load average) and the load average before each stage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.provenance import provenance
from tests.services.deploy import deployment
from tests.vllm.servers import INSTALLED, start, stop, wait_healthy

MODEL = "smollm2-135m"
SENTENCES = 33  # about 460 tokens of SmolLM2's tokenizer
MAX_TOKENS = 4
PAUSE_S = 1.0
NEVER = "\u2603never\u2603"  # a stop string no answer here contains
DRAIN_S = 120.0


def prompt(seed: int) -> str:
    base = 100 + (37 * seed) % 800
    return " ".join(f"The number {i} is followed by {i + 1}." for i in range(base, base + SENTENCES))


def ttft(url: str, seed: int, **extra: Any) -> dict[str, Any]:
    """One streaming completion: the client's TTFT, the prompt's tokens and the router's ``prfaas`` field."""
    body = {"model": MODEL, "prompt": prompt(seed), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    started, first, text, meta, usage = time.perf_counter(), None, "", {}, {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices", []):
                if choice.get("text") and first is None:
                    first = (time.perf_counter() - started) * 1e3
                text += choice.get("text") or ""
            meta, usage = chunk.get("prfaas", meta), chunk.get("usage") or usage
    if first is None:
        raise RuntimeError(f"{url} streamed no text")
    time.sleep(PAUSE_S)
    return {"ttft_ms": round(first, 1), "prompt_tokens": usage.get("prompt_tokens"), "text": text,
            "route": meta.get("route"), "stages": meta.get("stages")}


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    values = sorted(s["ttft_ms"] for s in samples)
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"n": len(values), "median_ms": round(statistics.median(values), 1), "min_ms": values[0],
            "max_ms": values[-1], "q1_ms": round(quartiles[0], 1), "q3_ms": round(quartiles[2], 1)}


def drain_prefill(url: str) -> None:
    httpx.post(f"{url}/admin/drain/prefill-0", timeout=30).raise_for_status()
    deadline = time.monotonic() + DRAIN_S
    while any(i["role"] == "prefill" for i in httpx.get(f"{url}/admin/instances", timeout=30).json()):
        if time.monotonic() > deadline:
            raise RuntimeError("the prefill instance did not drain")
        time.sleep(0.5)


def deployed(mode: str, samples: int, loads: dict[str, list[float]]) -> dict[str, list[dict[str, Any]]]:
    """The remote and local stages of one deployment; ``loads`` gets the load average before each."""
    out: dict[str, list[dict[str, Any]]] = {"remote": [], "remote_recompute_first": [], "local": []}
    with deployment(MODEL, mode, threshold=0, extra=("--engine", "vllm", "--dtype", "float32")) as (url, _):
        ttft(url, 999)  # warm-up: the first request of a vLLM server pays one-off costs
        loads["remote"] = list(os.getloadavg())
        for i in range(samples):
            out["remote"].append(ttft(url, i))
            out["remote_recompute_first"].append(ttft(url, i, stop=[NEVER]))
        drain_prefill(url)
        ttft(url, 998)
        loads["local"] = list(os.getloadavg())
        out["local"] = [ttft(url, i) for i in range(samples)]
    return out


def alone(samples: int, connector: bool) -> list[dict[str, Any]]:
    """vLLM alone with the flags prfaas's instance gives its child; ``connector``: ``PrfaasConnector`` loaded as a
    consumer that no request names a blob to."""
    from prfaas.engine import models

    args = ("--max-model-len", "4096", "--disable-uvicorn-access-log", "--enable-prompt-tokens-details")
    server = start(models.smollm2_dir(), "kv_consumer" if connector else None, name=MODEL, args=args)
    try:
        wait_healthy([server])
        ttft(server.url, 999)
        return [ttft(server.url, i) for i in range(samples)]
    finally:
        stop(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--mode", default="direct", choices=["direct", "relay"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vllm_router_ttft.json")
    args = parser.parse_args()
    if not INSTALLED:
        raise SystemExit("vLLM's CPU build is not installed: run `make vllm`")
    meta = provenance()
    loads: dict[str, list[float]] = {}
    stages = deployed(args.mode, args.samples, loads)
    for name, connector in (("vllm", False), ("vllm_with_connector", True)):
        loads[name] = list(os.getloadavg())
        stages[name] = alone(args.samples, connector)
    texts = {name: [s["text"] for s in rows] for name, rows in stages.items()}
    rows = {name: summary(samples) for name, samples in stages.items()}
    baselines = ("vllm", "vllm_with_connector")
    mono = min(rows[name]["median_ms"] for name in baselines)
    allowance = max(0.05 * mono, 10.0)  # 1 RTT (loopback: ~0) + 10 ms
    goal = {name: {"overhead_ms": round(r["median_ms"] - mono, 1), "allowance_ms": round(allowance, 1),
                   "met": r["median_ms"] - mono <= allowance, "over_local_ms": round(r["median_ms"] -
                                                                                      rows["local"]["median_ms"], 1)}
            for name, r in rows.items() if name not in baselines}
    result = {"provenance": meta, "mode": args.mode, "max_tokens": MAX_TOKENS, "load_average": loads,
              "same_text": all(texts[name] == texts["vllm"] for name in texts), "rows": rows, "goal": goal,
              "samples": stages}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, r in rows.items():
        extra = f"  overhead {goal[name]['overhead_ms']:+.1f} ms" if name in goal else ""
        print(f"{name:24} median {r['median_ms']:8.1f} ms  ({r['min_ms']}–{r['max_ms']}){extra}")
    print(f"same text as vLLM alone: {result['same_text']}; load average {loads}")


if __name__ == "__main__":
    main()
