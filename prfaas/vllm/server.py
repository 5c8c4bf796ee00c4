"""``VllmServer``: the vLLM OpenAI server a prfaas instance runs as its child (``--engine vllm``).

The instance process stays light (no torch, no vLLM): it starts ``prfaas.vllm.launch serve`` from vLLM's own
virtualenv (``.venv-vllm/bin/python``, or ``$PRFAAS_VLLM_PYTHON``) with ``PrfaasConnector`` in the role's KV role,
in a process group of its own, waits until it is healthy (bounded), reads what the connector wrote into its
``info_file`` (fingerprint, KV bytes per token, KV cache size), then talks to it over HTTP on 127.0.0.1 only.
A thread polls vLLM's ``/metrics`` for the heartbeat's load and the connector's ``tcp_file`` for the heartbeat's
``tcp_peers`` (the connector pulls and pushes in vLLM's process, so its ``TCP_INFO`` per peer reaches this one as
a file it rewrites after each transfer), and reports a vLLM that died (``on_death``: the instance then stops and
exits non-zero, to be restarted). ``stop`` ends the whole process group (SIGTERM, then
SIGKILL), so vLLM's engine process goes with it; the child also gets SIGTERM from the kernel if the instance dies.

Knobs from the environment (vLLM's, not prfaas's config): ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 1),
``PRFAAS_VLLM_MAX_MODEL_LEN`` (default 4096), ``PRFAAS_VLLM_START_S`` (default 600), ``PRFAAS_VLLM_ARGS`` (more
arguments for ``vllm serve``, shell-quoted).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prfaas.errors import InvalidRequest, KVUnavailable
from prfaas.messages import MAX_TCP_PEERS, TcpPeer
from prfaas.services.supervisor import die_with_parent

log = logging.getLogger("prfaas.vllm")
ROOT = Path(__file__).resolve().parents[2]
STOP_S = 10.0  # SIGTERM to SIGKILL: inside `prfaas up`'s own grace for the instance
POLL_S = 1.0


@dataclass(frozen=True)
class LaunchSpec:
    """One vLLM server: ``model_dir`` served as ``served_name`` in ``dtype``, ``kv_role`` kv_producer or
    kv_consumer, ``extra`` the connector's ``kv_connector_extra_config``."""

    model_dir: str
    served_name: str
    dtype: str
    kv_role: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Load:
    """vLLM's own figures, from its ``/metrics``."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0..1 of the KV cache


def vllm_python() -> str:
    """vLLM's virtualenv's interpreter; ``InvalidRequest`` saying how to make it when it is absent."""
    path = os.environ.get("PRFAAS_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not os.access(path, os.X_OK):
        raise InvalidRequest(f"--engine vllm needs vLLM's virtualenv: {path} is missing (run `make vllm`, or set "
                             "PRFAAS_VLLM_PYTHON to a python with vLLM and prfaas installed)")
    return path


def resolve_model(model: str, dtype: str) -> tuple[str, str]:
    """(model directory, dtype) for vLLM, resolved by ``prfaas.vllm.model`` in a child of this interpreter (it
    imports torch; this process does not)."""
    cmd = [sys.executable, "-m", "prfaas.vllm.model", model, dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise InvalidRequest(f"cannot serve {model!r} with vLLM: {lines[-1] if lines else done.returncode}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return str(answer["model_dir"]), str(answer["dtype"])


def eager() -> list[str]:
    """``--enforce-eager`` where ``$PRFAAS_VLLM_EAGER`` is 1: vLLM then runs its operators one by one, without its
    ``torch.compile`` graph (and CUDA graphs on a GPU), and starts sooner. Otherwise vLLM's own default, its graph
    (docs/vllm.md gives what each costs)."""
    value = os.environ.get("PRFAAS_VLLM_EAGER", "0")
    if value not in ("0", "1"):
        raise InvalidRequest(f"PRFAAS_VLLM_EAGER must be 0 or 1, not {value!r}")
    return ["--enforce-eager"] if value == "1" else []


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class VllmServer:
    """Owns the vLLM child from ``start`` to ``stop``; ``stop`` is idempotent and leaves no process."""

    def __init__(self, spec: LaunchSpec, on_death: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.on_death = on_death  # told, from the poller thread, when vLLM exits without being stopped
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.mkdtemp(prefix="prfaas-vllm-")
        self.info_file = os.path.join(self._dir, "info.json")
        self.tcp_file = os.path.join(self._dir, "tcp_peers.json")  # the connector's TCP_INFO per peer
        self.process: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self.max_model_len = 0
        self.load = Load()
        self.tcp_peers: list[TcpPeer] = []  # from tcp_file, refreshed with the load
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="vllm-metrics", daemon=True)

    def command(self) -> list[str]:
        config = {"kv_connector": "PrfaasConnector", "kv_connector_module_path": "prfaas.vllm.connector",
                  "kv_role": self.spec.kv_role, "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {**self.spec.extra, "info_file": self.info_file,
                                                "tcp_file": self.tcp_file}}
        return [vllm_python(), "-m", "prfaas.vllm.launch", "serve", self.spec.model_dir,
                "--served-model-name", self.spec.served_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", self.spec.dtype, *eager(), "--no-enable-prefix-caching",
                "--disable-uvicorn-access-log", "--enable-prompt-tokens-details",  # a recompute shows in usage
                "--max-model-len", os.environ.get("PRFAAS_VLLM_MAX_MODEL_LEN", "4096"),
                "--kv-transfer-config", json.dumps(config), *shlex.split(os.environ.get("PRFAAS_VLLM_ARGS", ""))]

    def start(self) -> None:
        """Start vLLM and wait until it is healthy and its connector has said who it is; on any failure the
        child is stopped and ``KVUnavailable`` says why."""
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        # vLLM logs to stdout; the instance's stdout is `prfaas up`'s line protocol, so vLLM's goes to stderr
        self.process = subprocess.Popen(self.command(), cwd=ROOT, env=env, start_new_session=True,
                                        stdout=sys.stderr, preexec_fn=die_with_parent)
        try:
            self._wait_healthy(float(os.environ.get("PRFAAS_VLLM_START_S", "600")))
            self.info = json.loads(Path(self.info_file).read_text())
            self.max_model_len = self._max_model_len()
        except BaseException:
            self.stop()
            raise
        self._poller.start()
        log.info("vLLM %s healthy at %s (pid %d)", self.spec.kv_role, self.url, self.process.pid)

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KVUnavailable(f"vLLM exited during start-up (exit {self.process.returncode}); its log is above")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200 and os.path.exists(
                        self.info_file):
                    return
            time.sleep(0.5)
        raise KVUnavailable(f"vLLM was not healthy within {timeout_s:.0f} s (PRFAAS_VLLM_START_S)")

    def _max_model_len(self) -> int:
        models = httpx.get(f"{self.url}/v1/models", timeout=10.0).json()["data"]
        return int(models[0].get("max_model_len") or 0)

    def _poll(self) -> None:
        """Each ``POLL_S``: vLLM's load, on one kept-alive connection (a client per poll cost its instance about
        20 ms of CPU a second in TLS set-up alone, on cores vLLM computes on), and the connector's TCP figures."""
        with httpx.Client(base_url=self.url, timeout=2.0) as client:
            while not self._stopping.wait(POLL_S):
                process = self.process
                if process is not None and process.poll() is not None:
                    if not self._stopping.is_set() and self.on_death is not None:
                        self.on_death(f"its vLLM server exited (code {process.returncode})")
                    return
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    self.load = parse_load(client.get("/metrics").text)
                self.tcp_peers = read_tcp_peers(self.tcp_file, self.tcp_peers)

    def stop(self) -> None:
        self._stopping.set()
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process is not None:
            _signal_group(process.pid, signal.SIGKILL)  # vLLM's engine process, should it outlive the server
        with contextlib.suppress(OSError):
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)


def parse_load(text: str) -> Load:
    """``Load`` from vLLM's Prometheus text (one engine: the first sample of each gauge)."""
    found: dict[str, float] = {}
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_LOAD_GAUGES))  # of some hundreds
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            if sample.name in _LOAD_GAUGES:
                found.setdefault(sample.name, sample.value)
    return Load(waiting=int(found.get("vllm:num_requests_waiting", 0)),
                running=int(found.get("vllm:num_requests_running", 0)),
                kv_usage=found.get("vllm:kv_cache_usage_perc", 0.0))


def read_tcp_peers(path: str, last: list[TcpPeer]) -> list[TcpPeer]:
    """The connector's ``tcp_file`` as typed records; ``last`` while there is none yet or it cannot be read (it is
    replaced whole, so a bad one is another writer's, and logged)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return last
    except (OSError, ValueError) as exc:
        log.warning("cannot read the connector's TCP figures in %s: %s", path, exc)
        return last
    try:
        if not isinstance(data, list):
            raise InvalidRequest(f"{path} must hold a list")
        return [TcpPeer.from_json(item) for item in data[-MAX_TCP_PEERS:]]
    except InvalidRequest as exc:
        log.warning("the connector's TCP figures in %s are not valid: %s", path, exc.message)
        return last


_LOAD_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
