"""Real vLLM servers for tests and benchmarks: vLLM's CPU build from ``.venv-vllm`` (``make vllm``) serving
SmolLM2-135M (or another model directory) fp32 through ``prfaas.vllm.launch``, each in its own process group so
that stopping it leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl as ssl_module
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from prfaas.store.memory import BlobStore
from prfaas.transfer import client
from prfaas.transfer.server import TransferServer
from tests.services.deploy import alive, descendants, free_port

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
INSTALLED = (VENV / ".installed").exists()
NEEDS_VLLM = pytest.mark.skipif(not INSTALLED, reason="vLLM's CPU build is not installed here: run `make vllm` "
                                "(scripts/install-vllm.sh)")
START_S = 240.0  # two servers started together on 2 cores: about 50-90 s (eager)
COMPILED_START_S = 480.0  # the same compiling vLLM's graph: about 150-160 s here, cache or not
MODEL = "smollm2"
# vLLM's CPU build reserves one CPU for its scheduler process and, with any KV connector configured, one more (for
# NIXL's transfers) before it binds its OpenMP threads to the rest, or to every CPU where that leaves none: on 2
# CPUs a server without a connector computes on one thread, one with PrfaasConnector on two. A baseline without a
# connector gets the same reservation, so that it computes on the same threads as the servers it is compared with.
CONNECTOR_CPUS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}
# `prfaas up --engine vllm` runs vLLM's compiled graph unless told otherwise; its deployments in tests run eagerly, a
# third of the start-up (test_connector.py's pair runs the graph).
EAGER = {"PRFAAS_VLLM_EAGER": "1"}


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    def text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def tail(self) -> str:
        return self.text()[-4000:]

    def first_error(self) -> str:
        """The log from its first error or traceback on (60 lines): vLLM's engine process logs the root cause
        there, and the API server's own traceback, which fills the tail, only says that the engine failed."""
        lines = self.text().splitlines()
        first = next((i for i, line in enumerate(lines) if " ERROR " in line or line.startswith("Traceback")), None)
        return "(none logged)" if first is None else "\n".join(lines[first:first + 60])


def start(model_dir: Path, role: str | None, extra: dict[str, Any] | None = None, *, name: str = MODEL,
          args: tuple[str, ...] = (), env: dict[str, str] | None = None, eager: bool = True) -> Server:
    """``prfaas.vllm.launch serve`` on a free port, with ``PrfaasConnector`` as ``role`` (None: plain vLLM),
    serving ``model_dir`` as ``name``; ``args`` are appended to vLLM's command line (``--block-size 32``), ``env``
    to its environment (``CONNECTOR_CPUS``); ``eager``: ``--enforce-eager`` (else vLLM compiles its graph, as
    ``prfaas up --engine vllm`` lets it by default)."""
    port = free_port()
    config = {"kv_connector": "PrfaasConnector", "kv_connector_module_path": "prfaas.vllm.connector",
              "kv_role": role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra or {}}
    cmd = [str(VENV / "bin" / "python"), "-m", "prfaas.vllm.launch", "serve", str(model_dir),
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           *(["--enforce-eager"] if eager else []), "--max-model-len", "1024", "--no-enable-prefix-caching",
           *(["--kv-transfer-config", json.dumps(config)] if role else []), *args]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", **(env or {})}
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in _stop)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(f"http://127.0.0.1:{port}", proc, log)


def wait_healthy(servers: list[Server], start_s: float = START_S) -> None:
    deadline = time.monotonic() + start_s
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            assert server.proc.poll() is None, (f"vLLM exited during start-up; its first error:\n"
                                                f"{server.first_error()}\n…its log's end:\n{server.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    waiting.remove(server)
        assert time.monotonic() < deadline, f"vLLM not healthy in {start_s} s:\n{waiting[0].tail()}"
        time.sleep(1)


def stop(server: Server) -> list[int]:
    """SIGTERM to the server's process group, SIGKILL after 30 s; returns the processes still alive after."""
    children = descendants(server.proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (left := [p for p in children if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.log.close()
    return left


def deployed_servers(pid: int, kv_role: str) -> dict[int, int]:
    """The vLLM servers with ``kv_role`` (``kv_consumer``: the decode instances') that the processes under ``pid``
    (``prfaas up``) started: their pid → port, read from their command lines."""
    found = {}
    for child in descendants(pid):
        try:
            args = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "prfaas.vllm.launch" in args and any(kv_role in a for a in args):
            found[child] = int(args[args.index("--port") + 1])
    return found


def complete(server: Server, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """A ``/v1/completions`` request that must succeed; its JSON body."""
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout_s)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def prompt_sources(server: Server) -> dict[str, float]:
    """vLLM's ``prompt_tokens_by_source`` counters: local_compute, local_cache_hit, external_kv_transfer."""
    found = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            found[source] = float(line.rsplit(" ", 1)[1])
    return found


def wait_no_blobs(address: str, wait_s: float = 10.0) -> bool:
    """Whether the prfaas store at ``address`` holds no blob, waiting up to ``wait_s`` (releases are async)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if asyncio.run(client.stat(address))["blobs"] == 0:
            return True
        time.sleep(0.2)
    return False


class StoreThread:
    """A prfaas store and its data-plane server (a relay, or a store of the test's own) on an event loop thread of
    this process, for vLLM's connector to push to or pull from."""

    def __init__(self, ttl_s: float = 60.0, ssl: ssl_module.SSLContext | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.store = BlobStore(1 << 30, ttl_s)
        self.server = TransferServer(self.store, ssl=ssl)
        self.address = f"127.0.0.1:{self.call(self.server.start())}"

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _stop(self) -> None:
        await self.server.close()
        self.store.close()
