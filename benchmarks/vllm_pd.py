"""vLLM monolithic against prfaas + vLLM disaggregated (direct, relay) and vLLM's own P/D (NixlConnector), one run.

    make vllm-bench        # = make vllm; scripts/install-vllm.sh --nixl; this script with the flags the docs used
    .venv/bin/python benchmarks/vllm_pd.py [--repeats 2] [--stages mono,prfaas,nixl,lab] [--out FILE.json]

Peers (vLLM's CPU build from ``.venv-vllm``, SmolLM2-135M, ``--dtype float32``, ``--enforce-eager``, prefix caching
off; each vLLM server's dtype is read back from its own start-up log):

- ``mono``: one plain vLLM server, no connector, on the OpenMP threads a connector's server gets
  (``tests.vllm.servers.CONNECTOR_CPUS``);
- ``prfaas-direct`` / ``prfaas-relay``: a ``PrfaasConnector`` producer and consumer driven connector-level (as
  vLLM's ``toy_proxy_server.py`` does it: P with ``max_tokens: 1`` and ``do_remote_decode``, then D with the
  params P returned), not through ``prfaas up --engine vllm``; relay mode pushes into a prfaas relay store (a
  ``BlobStore`` + ``TransferServer`` in a process of its own, this script with ``--serve-relay``);
- ``nixl``: vLLM's own ``NixlConnector`` (``kv_buffer_device: cpu``, UCX), the same toy-proxy flow, if NIXL is
  installed (``scripts/install-vllm.sh --nixl``) and runs; if not, the error is recorded;
- ``lab-direct`` / ``lab-relay`` (root only): the prfaas pair again with the producer in datacenter A and the
  consumer (and the relay) in datacenter B of a ``prfaas.lab`` (network namespaces, ``tbf`` 1 Gbit, user-space
  delay); this client sits beside B (unshaped host link), so P's HTTP request also crosses the WAN, as the
  router's ``/prefill`` does.

Per peer and concurrency c in ``--concurrency`` (1, 8, 32): c clients issue ``max(c, --min-requests)`` requests
of ``--prompt-sentences`` counting sentences (about 250 tokens) and ``--max-tokens`` output tokens
(``ignore_eos``), streaming from the decoding server. Per repeat: output tokens/s = Σ ``usage.completion_tokens``
/ wall time; per request: TTFT (from P's request to D's first token for P/D), ``prefill_ms`` (P's reply),
``beyond_prefill_ms`` = TTFT − ``prefill_ms``, TPOT, KV bytes (prfaas: the blob's bytes from P's params; NIXL: its
``vllm:nixl_bytes_transferred`` on D). The table gives medians, and the spread over repeats (min–max).

Memory bounds what runs at once (a vLLM server here is about 4 GB): the peers run in stages of at most two
servers, so figures of different stages saw different loads from other work on the machine; each stage and level
records its load average. Each level is bounded (``--level-timeout-s``; a peer past it is marked ``*`` and not run
at higher levels), a failed request is counted, not fatal, a stage that cannot run records why, and the JSON is
rewritten after every stage (``complete`` false until the last). Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.provenance import provenance
from tests.services.deploy import free_port
from tests.vllm.servers import CONNECTOR_CPUS, INSTALLED, MODEL, ROOT, VENV, Server, stop, wait_healthy

NIXL_P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}  # vLLM's toy proxy's
LAB_RATE, LAB_DELAY_MS = "1gbit", 5.0  # one-way: RTT 10 ms
LAB_INDEX = 11  # prfaas.lab Topology.numbered: clear of `prfaas lab` (dc-a/dc-b) and the tests' numbers


@dataclass(frozen=True)
class Peer:
    """A system under test: ``prefill`` None is monolithic; else the toy-proxy flow with ``p_params``."""

    name: str
    decode: Server
    prefill: Server | None = None
    p_params: dict[str, Any] = field(default_factory=dict)
    rtt_ms: float = 0.0  # of the link between P and D (0: loopback)
    nixl: bool = False  # KV bytes from D's NIXL counter (NIXL's params do not carry them)


@dataclass
class Sample:
    prompt_tokens: int
    ttft_ms: float
    prefill_ms: float
    e2e_ms: float
    tokens: int
    kv_bytes: int

    @property
    def tpot_ms(self) -> float:
        return (self.e2e_ms - self.ttft_ms) / max(1, self.tokens - 1)


# --- servers -------------------------------------------------------------------------------------------------------

def launch(model_dir: Path, kv_config: dict[str, Any] | None, host: str = "127.0.0.1", netns: str | None = None,
           env: dict[str, str] | None = None, url_host: str | None = None) -> Server:
    """``prfaas.vllm.launch serve`` on a free port (in ``netns`` if given), with ``kv_config`` as its
    ``--kv-transfer-config`` (None: plain vLLM); each in its own process group (``stop`` ends all of it)."""
    port = free_port()
    cmd = [str(VENV / "bin" / "python"), "-m", "prfaas.vllm.launch", "serve", str(model_dir),
           "--served-model-name", MODEL, "--host", host, "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "1024", "--no-enable-prefix-caching",
           *(["--kv-transfer-config", json.dumps(kv_config)] if kv_config else [])]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", **(env or {})}
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(f"http://{url_host or host}:{port}", proc, log)


def prfaas_config(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "PrfaasConnector", "kv_connector_module_path": "prfaas.vllm.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def nixl_env(side_port: int) -> dict[str, str]:
    # NIXL's CPU worker moves its main thread onto the last core of each NUMA node (kept for KV transfers); with
    # vLLM's default OpenMP binding (one thread per core) that stacks two spinning OpenMP threads on one core and
    # decoding crawls (0.1 tokens/s seen here). Unbound OpenMP threads let the second one move to the free core.
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def dtype_of(server: Server) -> str:
    """The dtype vLLM says it runs in (its engine's start-up line), not the one asked for."""
    found = re.search(r"dtype=torch\.(\w+)", server.text())
    return found.group(1) if found else "unknown"


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[dict[str, Any]]:
    """Wait for ``servers`` to be healthy; yields the stage's facts; stops them all, recording what was left."""
    facts: dict[str, Any] = {"loadavg_start": os.getloadavg()[0]}
    try:
        started = time.monotonic()
        wait_healthy(servers)
        facts["start_s"] = round(time.monotonic() - started, 1)
        facts["dtypes"] = [dtype_of(s) for s in servers]
        yield facts
    finally:
        facts["loadavg_end"] = os.getloadavg()[0]
        facts["processes_left"] = [pid for s in servers for pid in stop(s)]


@contextlib.contextmanager
def relay_process(host: str, netns: str | None = None) -> Iterator[str]:
    """A prfaas relay store in its own process (this script, ``--serve-relay``): yields its address."""
    port = free_port()
    cmd = [sys.executable, __file__, "--serve-relay", f"{host}:{port}"]
    proc = subprocess.Popen(["ip", "netns", "exec", netns, *cmd] if netns else cmd, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready", "the relay did not start"
        yield f"{host}:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def serve_relay(address: str) -> None:
    from prfaas.store.memory import BlobStore
    from prfaas.transfer.server import TransferServer

    async def main() -> None:
        host, port = address.rsplit(":", 1)
        server = TransferServer(BlobStore(2 << 30, 120.0), host=host, port=int(port))
        await server.start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# --- requests ------------------------------------------------------------------------------------------------------

def prompt(sentences: int, seed: int) -> str:
    base = 100 + (37 * seed) % 800  # a new prompt per request, three-digit numbers throughout
    return " ".join(f"The number {i} is followed by {i + 1}." for i in range(base, base + sentences))


async def one(client: httpx.AsyncClient, peer: Peer, text: str, max_tokens: int) -> Sample:
    body: dict[str, Any] = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    started = time.perf_counter()
    prefill_ms, kv_bytes = 0.0, 0
    if peer.prefill is not None:
        reply = await client.post(f"{peer.prefill.url}/v1/completions",
                                  json={**body, "max_tokens": 1, "kv_transfer_params": peer.p_params})
        if reply.status_code != 200:
            raise RuntimeError(f"prefill answered {reply.status_code}: {reply.text[:300]}")
        params = reply.json()["kv_transfer_params"]
        prefill_ms, kv_bytes = (time.perf_counter() - started) * 1e3, int(params.get("kv_bytes", 0))
        body["kv_transfer_params"] = params
    first, usage = await stream(client, peer.decode, body)
    done = time.perf_counter()
    if not first or not usage["completion_tokens"]:
        raise RuntimeError(f"{peer.decode.url} streamed no token (usage {usage})")
    return Sample(usage["prompt_tokens"], (first - started) * 1e3, prefill_ms, (done - started) * 1e3,
                  usage["completion_tokens"], kv_bytes)


async def stream(client: httpx.AsyncClient, server: Server, body: dict[str, Any]) -> tuple[float, dict[str, int]]:
    """Streams a completion; returns when its first token came and the final ``usage``."""
    first, usage = 0.0, {"prompt_tokens": 0, "completion_tokens": 0}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{server.url} answered {reply.status_code}: {(await reply.aread()).decode()[:300]}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and not first:
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = {k: int(chunk["usage"][k]) for k in usage}
    return first, usage


async def level(peer: Peer, c: int, n: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """``n`` requests from ``c`` concurrent clients; output tokens/s and the per-request samples."""
    queue = list(range(seed, seed + n))
    samples: list[Sample] = []
    errors: list[str] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            try:
                samples.append(await one(client, peer, prompt(args.prompt_sentences, queue.pop()), args.max_tokens))
            except (httpx.HTTPError, RuntimeError, KeyError) as exc:  # a failed request is a result: count it
                errors.append(f"{type(exc).__name__}: {exc}"[:300])

    limits = httpx.Limits(max_connections=2 * c + 2, max_keepalive_connections=2 * c + 2)
    nixl_before, timed_out = nixl_bytes(peer.decode), False
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        try:  # bounded: a peer that crawls is recorded as such instead of stalling the whole run
            await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(c))), args.level_timeout_s)
        except TimeoutError:
            timed_out = True
        wall = time.perf_counter() - started
    if peer.nixl and samples:  # NIXL does not say per request: its D's counter over the level
        for s in samples:
            s.kv_bytes = round((nixl_bytes(peer.decode) - nixl_before) / len(samples))
    return {"c": c, "requests": n, "completed": len(samples), "errors": errors, "timed_out": timed_out,
            "wall_s": wall,
            "tokens_per_s": sum(s.tokens for s in samples) / wall,
            "samples": [{**asdict(s), "tpot_ms": s.tpot_ms} for s in samples]}


def nixl_bytes(server: Server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:nixl_bytes_transferred_sum"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def external_tokens(server: Server) -> float:
    """vLLM's count of prompt tokens whose KV came from a connector (so were not recomputed)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="external_kv_transfer"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def measure(peers: list[Peer], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every peer at every concurrency, repeats interleaved so that the peers of a stage share its noise."""
    out: dict[str, list[dict[str, Any]]] = {p.name: [] for p in peers}
    for peer in peers:  # a warm-up request each: the first one pays for lazy set-up (NIXL's handshake)
        asyncio.run(level(peer, 1, 1, args, seed=900))
    for repeat in range(args.repeats):
        for c in args.concurrency:
            for peer in peers:
                if any(lv["timed_out"] for lv in out[peer.name]):
                    continue  # it already ran past the bound once: higher levels would too
                n = max(c, args.min_requests)
                before = external_tokens(peer.decode)
                got = asyncio.run(level(peer, c, n, args, seed=1000 * repeat + c))
                got["external_tokens"] = external_tokens(peer.decode) - before
                got["repeat"], got["loadavg_1m"] = repeat, os.getloadavg()[0]
                out[peer.name].append(got)
                print(f"  {peer.name:14} c={c:<3} {got['tokens_per_s']:7.1f} tok/s, {len(got['errors'])} failed"
                      f"{' (timed out)' if got['timed_out'] else ''}", flush=True)
    return out


# --- stages --------------------------------------------------------------------------------------------------------

def stage_mono(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    server = launch(model_dir, None, env=CONNECTOR_CPUS)  # the OpenMP threads the connector's servers get
    with running([server]) as facts:
        facts["peers"] = measure([Peer("mono", server)], args)
    return facts


def stage_prfaas(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    kv_address = f"127.0.0.1:{free_port()}"
    with relay_process("127.0.0.1") as relay:
        producer = launch(model_dir, prfaas_config("kv_producer", {"kv_address": kv_address, "relays": [relay]}))
        consumer = launch(model_dir, prfaas_config("kv_consumer", {}))
        with running([producer, consumer]) as facts:
            peers = [Peer("prfaas-direct", consumer, producer, {"do_remote_decode": True}),
                     Peer("prfaas-relay", consumer, producer, {"do_remote_decode": True, "relay": relay})]
            facts["peers"] = measure(peers, args)
    return facts


def stage_nixl(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    try:
        import_check = subprocess.run([str(VENV / "bin" / "python"), "-c", "from nixl._api import nixl_agent"],
                                      capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"error": "importing nixl took over 120 s"}
    if import_check.returncode != 0:
        return {"error": "nixl is not installed in .venv-vllm (scripts/install-vllm.sh --nixl): "
                         + import_check.stderr.strip().splitlines()[-1]}
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    servers = [launch(model_dir, config, env=nixl_env(free_port())) for _ in range(2)]
    with running(servers) as facts:
        facts["env"] = {k: v for k, v in nixl_env(0).items() if k == "VLLM_CPU_OMP_THREADS_BIND"}
        facts["peers"] = measure([Peer("nixl", servers[1], servers[0], NIXL_P_PARAMS, nixl=True)], args)
    return facts


@contextlib.contextmanager
def lab_wan() -> Iterator[Any]:
    """A prfaas lab (1 Gbit, RTT 10 ms) with routes so that this namespace reaches datacenter A through B."""
    from prfaas.lab import Lab, LinkSettings, Topology

    topo = Topology.numbered(LAB_INDEX)
    host_net, wan_net = f"10.{topo.subnet + 1}.0.0/24", f"10.{topo.subnet}.0.0/24"
    with Lab(LinkSettings(rate=LAB_RATE, delay_ms=LAB_DELAY_MS), topo=topo):
        for argv in (["ip", "netns", "exec", topo.ns_b, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                     ["ip", "-n", topo.ns_a, "route", "add", host_net, "via", topo.wan_b],
                     ["ip", "route", "add", wan_net, "via", topo.public_b]):
            subprocess.run(argv, check=True, capture_output=True)
        try:
            yield topo
        finally:
            subprocess.run(["ip", "route", "del", wan_net], capture_output=True)


def stage_lab(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    if os.geteuid() != 0:
        return {"error": "the lab needs root (network namespaces)"}
    with lab_wan() as topo:
        rtt = ping_ms(topo.wan_a)
        kv_address = f"{topo.wan_a}:{free_port()}"
        with relay_process(topo.wan_b, netns=topo.ns_b) as relay:
            producer = launch(model_dir, prfaas_config("kv_producer", {"kv_address": kv_address, "relays": [relay]}),
                              host="0.0.0.0", netns=topo.ns_a, url_host=topo.wan_a)
            consumer = launch(model_dir, prfaas_config("kv_consumer", {}), host="0.0.0.0", netns=topo.ns_b,
                              url_host=topo.public_b)
            with running([producer, consumer]) as facts:
                facts["link"] = {"rate": LAB_RATE, "delay_ms_one_way": LAB_DELAY_MS, "rtt_ms_measured": rtt}
                peers = [Peer("lab-direct", consumer, producer, {"do_remote_decode": True}, rtt),
                         Peer("lab-relay", consumer, producer, {"do_remote_decode": True, "relay": relay}, rtt)]
                facts["peers"] = measure(peers, args)
    return facts


STAGES = {"mono": stage_mono, "prfaas": stage_prfaas, "nixl": stage_nixl, "lab": stage_lab}


def ping_ms(host: str) -> float:
    """Median round trip from here to ``host``: a TCP connect to a closed port there is refused after one RTT."""
    times = []
    for _ in range(7):
        started = time.perf_counter()
        with contextlib.suppress(ConnectionRefusedError), socket.create_connection((host, 9), timeout=5):
            pass
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


# --- summary -------------------------------------------------------------------------------------------------------

def summarize(stages: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per peer and concurrency: medians over repeats (and over requests for per-request figures)."""
    rows = []
    mono = {r["c"]: r for r in _rows_of(stages, "mono")}
    for name in _peer_names(stages):
        for row in _rows_of(stages, name):
            row["vs_mono_tokens_per_s"] = row["tokens_per_s"] / mono[row["c"]]["tokens_per_s"] if mono else None
            rows.append(row)
    return rows


def _peer_names(stages: dict[str, dict[str, Any]]) -> list[str]:
    return [name for stage in stages.values() for name in stage.get("peers", {})]


def _rows_of(stages: dict[str, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    levels: list[dict[str, Any]] = next((s["peers"][name] for s in stages.values() if name in s.get("peers", {})), [])
    rows = []
    for c in sorted({lv["c"] for lv in levels}):
        mine = [lv for lv in levels if lv["c"] == c]
        # a stream without a token is a failed request (runs before that check recorded it as a sample)
        samples = [s for lv in mine for s in lv["samples"] if s["ttft_ms"] > 0 and s["tokens"] > 0]
        if not samples:
            continue
        rates = [lv["tokens_per_s"] for lv in mine]
        row = {"peer": name, "c": c, "repeats": len(mine), "requests": len(samples),
               "failed": sum(len(lv.get("errors", [])) + len(lv["samples"]) for lv in mine) - len(samples),
               "timed_out": any(lv["timed_out"] for lv in mine),
               "tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates),
               "tokens_per_s_max": max(rates), "external_tokens": sum(lv["external_tokens"] for lv in mine)}
        for key in ("prompt_tokens", "ttft_ms", "prefill_ms", "tpot_ms", "kv_bytes"):
            row[key] = statistics.median(s[key] for s in samples)
        ttfts = [s["ttft_ms"] for s in samples]
        row["ttft_ms_min"], row["ttft_ms_max"] = min(ttfts), max(ttfts)
        row["beyond_prefill_ms"] = statistics.median(s["ttft_ms"] - s["prefill_ms"] for s in samples)
        rows.append(row)
    return rows


def goals(rows: list[dict[str, Any]], rtts: dict[str, float]) -> list[dict[str, Any]]:
    """The goals per level: TTFT overhead ≤ max(5 %, 1 RTT + 10 ms) against mono; decode per decode instance ≥
    0.95 × mono, taken as TPOT (the pair's output tokens/s also counts P's prefill, sequential in this flow)."""
    mono = {r["c"]: r for r in rows if r["peer"] == "mono"}
    out = []
    for r in rows:
        if r["peer"] == "mono" or r["c"] not in mono:
            continue
        base = mono[r["c"]]
        allowed = max(0.05 * base["ttft_ms"], rtts.get(r["peer"], 0.0) + 10.0)
        overhead = r["ttft_ms"] - base["ttft_ms"]
        out.append({"peer": r["peer"], "c": r["c"], "ttft_overhead_ms": overhead, "allowed_ms": allowed,
                    "ttft_goal_met": overhead <= allowed,
                    "decode_ratio": r["tokens_per_s"] / base["tokens_per_s"],
                    "tpot_ratio": base["tpot_ms"] / r["tpot_ms"],
                    "decode_goal_met": base["tpot_ms"] / r["tpot_ms"] >= 0.95})
    return out


def cpu() -> dict[str, Any]:
    """The CPU's model and the instruction sets that decide float32/bfloat16 speed and vLLM's attention kernel."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}
    flags = set(fields.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": fields.get("model name", ""), "cores": os.cpu_count(), "isa": [f for f in wanted if f in flags]}


def table(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    lines = [f"{'peer':14} {'c':>3} {'tok/s':>7} {'(min-max)':>13} {'×mono':>6} {'TTFT':>7} {'prefill':>8} "
             f"{'beyond':>7} {'TPOT':>6} {'KV MiB':>7}"]
    for r in rows:
        ratio = f"{r['vs_mono_tokens_per_s']:.2f}" if r.get("vs_mono_tokens_per_s") else "-"
        peer = r["peer"] + ("*" if r.get("timed_out") else "")
        lines.append(f"{peer:14} {r['c']:>3} {r['tokens_per_s']:>7.1f} "
                     f"{r['tokens_per_s_min']:>6.1f}-{r['tokens_per_s_max']:<6.1f} {ratio:>6} {r['ttft_ms']:>7.0f} "
                     f"{r['prefill_ms']:>8.0f} {r['beyond_prefill_ms']:>7.0f} {r['tpot_ms']:>6.0f} "
                     f"{r['kv_bytes'] / 2**20:>7.1f}")
    for g in checks:
        lines.append(f"goal {g['peer']:14} c={g['c']:<3} TTFT overhead {g['ttft_overhead_ms']:7.0f} ms "
                     f"(allowed {g['allowed_ms']:.0f}: {'met' if g['ttft_goal_met'] else 'not met'}); "
                     f"tok/s {g['decode_ratio']:.2f}× mono, decode (1/TPOT) {g['tpot_ratio']:.2f}× "
                     f"({'met' if g['decode_goal_met'] else 'not met'})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--min-requests", type=int, default=3, help="requests per level at least (c = 1: 3)")
    parser.add_argument("--prompt-sentences", type=int, default=18, help="18: about 250 prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--level-timeout-s", type=float, default=240.0, help="bound on one concurrency level")
    parser.add_argument("--stages", type=lambda s: s.split(","), default=list(STAGES),
                        help="which of mono,prfaas,nixl,lab (the lab needs root)")
    parser.add_argument("--lab-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--out", default="benchmarks/results/vllm_pd.json")
    parser.add_argument("--resummarize", action="store_true", help="recompute --out's rows and goals, run nothing")
    parser.add_argument("--serve-relay", metavar="HOST:PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_relay:
        serve_relay(args.serve_relay)
        return
    if args.resummarize:
        resummarize(Path(args.out))
        return
    if not INSTALLED:
        sys.exit("vLLM's CPU build is not installed: run `make vllm`")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers, take the lab down
    from prfaas.engine import models

    model_dir, started = models.smollm2_dir(), time.monotonic()
    stages: dict[str, dict[str, Any]] = {}
    lab_args = argparse.Namespace(**{**vars(args), "concurrency": args.lab_concurrency})
    for name in args.stages:
        print(f"stage {name}", flush=True)
        try:
            stages[name] = STAGES[name](model_dir, lab_args if name == "lab" else args)
        except Exception as exc:  # a peer that cannot run is a measured answer: say why, go on with the others
            stages[name] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
        result = report(stages, args, time.monotonic() - started, complete=name == args.stages[-1])
        write(Path(args.out), result)  # after every stage: a run cut short keeps what it measured
    for name, stage in stages.items():
        load = f"{stage.get('loadavg_start', 0):.1f}→{stage.get('loadavg_end', 0):.1f}"
        error = stage.get("error", "").splitlines()[:1]
        print(f"stage {name}: {error[0] if error else ''} start {stage.get('start_s')} s, dtypes "
              f"{stage.get('dtypes')}, load average {load}")
    print(table(result["rows"], result["goals"]))


def report(stages: dict[str, dict[str, Any]], args: argparse.Namespace, wall_s: float,
           complete: bool) -> dict[str, Any]:
    rows = summarize(stages)
    link = stages.get("lab", {}).get("link", {})
    rtts = {p: link["rtt_ms_measured"] for p in ("lab-direct", "lab-relay") if link}
    return {"provenance": provenance(), "model": "smollm2-135m", "dtype_asked": "float32",
            "engine": "vllm-cpu 0.32.0", "cpu": cpu(),
            "workload": {"prompt_sentences": args.prompt_sentences, "max_tokens": args.max_tokens,
                         "ignore_eos": True, "repeats": args.repeats, "concurrency": args.concurrency,
                         "lab_concurrency": args.lab_concurrency, "min_requests": args.min_requests,
                         "level_timeout_s": args.level_timeout_s},
            "driven": "connector-level (vLLM's toy-proxy flow from this client), not through prfaas's router",
            "complete": complete, "wall_s": round(wall_s, 1), "rows": rows, "goals": goals(rows, rtts),
            "stages": stages}


def resummarize(path: Path) -> None:
    old = json.loads(path.read_text())
    stages = old["stages"]
    link = stages.get("lab", {}).get("link", {})
    rows = summarize(stages)
    old.update(rows=rows, goals=goals(rows, {p: link["rtt_ms_measured"] for p in ("lab-direct", "lab-relay") if link}))
    write(path, old)
    print(table(old["rows"], old["goals"]))


def write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")

if __name__ == "__main__":
    main()
