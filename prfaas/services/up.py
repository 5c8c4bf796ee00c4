"""``prfaas up``: a whole deployment on this machine, every role its own process on 127.0.0.1.

Start order: router, relay, prefill, decode. The router URL is printed once ``/health`` is 200; a role that exits
before that stops the start (a bad config fails at once rather than in a restart loop). From then on a role that
fails is restarted with back-off, each decision one line on stdout (``prfaas.services.supervisor``); the deployment
ends when the router is gone for good. SIGINT/SIGTERM stop the supervision, then the children in reverse order
(SIGINT, which stops an instance without a drain, then SIGKILL after a grace period); children also get SIGTERM
from the kernel if this process dies, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from prfaas.errors import InvalidRequest, PrfaasError
from prfaas.security import local
from prfaas.services.supervisor import RestartPolicy, Role, Supervisor, die_with_parent

STOP_GRACE_S = 15.0
SUPERVISE_INTERVAL_S = 0.2


@dataclass(frozen=True)
class UpOptions:
    model: str = "smollm2-135m"
    mode: str = "relay"
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    offload_threshold: int | None = None
    config: str | None = None
    dtype: str = "float32"
    engine: str = "prfaas"  # of the prefill and decode instances: prfaas | vllm (prfaas.vllm.serving)
    startup_timeout_s: float = 600.0
    log_file: str | None = None  # children's output goes here instead of this terminal
    lab: bool = False  # place each role in its datacenter of the lab (`prfaas lab up` first)
    tls: bool = False  # mutual TLS 1.3 on every hop, certificates in a temporary directory (prfaas.security.local)
    max_restarts: int = 10  # failures in a row before a role is given up; 0: never restart (prfaas.services.supervisor)



class Deployment:
    def __init__(self, options: UpOptions) -> None:
        if options.mode not in ("relay", "direct"):
            raise InvalidRequest("--mode must be relay or direct")
        if options.engine not in ("prfaas", "vllm"):
            raise InvalidRequest("--engine must be prfaas or vllm")
        if options.prefill < 1 or options.decode < 1:
            raise InvalidRequest("--prefill and --decode must be at least 1")
        self.options = options
        self.roles: list[Role] = []  # start order, router first; the supervisor watches this same list
        self.supervisor = Supervisor(self.roles, RestartPolicy(max_restarts=options.max_restarts), _say)
        self.tls_dir = tempfile.mkdtemp(prefix="prfaas-tls-") if options.tls else None
        self.tls_configs = local.tls_configs(self.tls_dir, options.config) if self.tls_dir else {}

    @property
    def children(self) -> list[subprocess.Popen[bytes]]:
        """Each role's current process, in start order."""
        return [role.process for role in self.roles]

    @property
    def url(self) -> str:
        if self.options.lab:
            from prfaas.lab.placement import client_url

            return client_url(self.options.port)
        return f"{'https' if self.tls_dir else 'http'}://{self.options.host}:{self.options.port}"

    def start(self) -> None:
        o = self.options
        if o.lab:
            from prfaas.lab.placement import require_lab

            require_lab()
        else:
            _check_free(o.host, o.port)
        self._spawn(["router", "--host", o.host, "--port", str(o.port), "--mode", o.mode])
        if o.mode == "relay":
            self._spawn(["relay", "--instance-id", "relay-0", "--datacenter", "dc-b"])
        for i in range(o.prefill):
            self._spawn(["prefill", "--instance-id", f"prefill-{i}", "--datacenter", "dc-a", *self._model()])
        for i in range(o.decode):
            self._spawn(["decode", "--instance-id", f"decode-{i}", "--datacenter", "dc-b", *self._model()])

    def _model(self) -> list[str]:
        return ["--model", self.options.model, "--dtype", self.options.dtype, "--engine", self.options.engine]

    def _spawn(self, args: list[str]) -> None:
        o = self.options
        common = ["--router", self.url] if args[0] != "router" else []
        if o.config or self.tls_configs:
            common += ["--config", self.tls_configs.get(args[0], o.config or "")]
        if o.offload_threshold is not None:
            common += ["--offload-threshold", str(o.offload_threshold)]
        cmd = [sys.executable, "-m", "prfaas", "serve", *args, *common]
        if o.lab:
            from prfaas.lab.placement import place, router_url

            cmd = place(args[0], [router_url(o.port) if a == self.url else a for a in cmd])
        name = args[0] if args[0] == "router" else f"{args[0]} {args[2]}"  # args[2]: the --instance-id
        self.roles.append(Role(name, lambda: self._popen(cmd), time.monotonic))

    def _popen(self, cmd: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.options.log_file, "ab") if self.options.log_file else None  # noqa: SIM115 (closed below)
        try:
            return subprocess.Popen(cmd, preexec_fn=die_with_parent, stdout=out, stderr=out)
        finally:
            if out:
                out.close()  # the child holds its own descriptor

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            dead = [r for r in self.roles if r.process.poll() is not None]
            if dead:
                raise PrfaasError(f"a role exited during start-up: {dead[0].name} (exit {dead[0].process.returncode})")
            with contextlib.suppress(httpx.HTTPError):
                verify = local.ca_client_context(self.tls_configs["ca"]) if self.tls_dir else True
                if httpx.get(f"{self.url}/health", timeout=2.0, verify=verify).status_code == 200:
                    return
            time.sleep(0.25)
        raise PrfaasError(f"the deployment was not healthy within {self.options.startup_timeout_s:.0f} s")

    def supervise(self, stopping: Callable[[], bool]) -> None:
        """Restart failed roles until ``stopping()`` or the router is gone for good (a clean exit: drained; or
        given up). Returns without starting anything once ``stopping()`` is true."""
        router = self.roles[0]
        while not stopping() and not router.done:
            self.supervisor.check()
            time.sleep(SUPERVISE_INTERVAL_S)

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.poll() is None:
                child.send_signal(signal.SIGINT)  # stop now: SIGTERM would drain each instance first
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=STOP_GRACE_S)
            if child.poll() is None:
                child.kill()
                child.wait()
        self.roles.clear()
        if self.tls_dir:
            shutil.rmtree(self.tls_dir, ignore_errors=True)


def _say(line: str) -> None:
    print(f"prfaas up: {line}", flush=True)


def _check_free(host: str, port: int) -> None:
    """``InvalidRequest`` now, rather than a router that dies after the other roles have started."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router's server binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise InvalidRequest(f"the router cannot listen on {host}:{port} ({exc.strerror}): choose another --port"
                                 ) from exc


def run_up(options: UpOptions) -> None:
    deployment = Deployment(options)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        deployment.start()
        deployment.wait_ready()
        print(f"prfaas is up: {deployment.url}/v1 (mode {options.mode}, model {options.model}, "
              f"{options.prefill} prefill, {options.decode} decode"
              f"{', mutual TLS, CA ' + deployment.tls_configs['ca'] if options.tls else ''})", flush=True)
        deployment.supervise(lambda: stop["now"])
    finally:
        restarts = deployment.supervisor.restarts()
        deployment.stop()
        counts = ", ".join(f"{name} {n}" for name, n in restarts.items())
        print(f"prfaas stopped: every process has exited{'; restarts: ' + counts if counts else ''}", flush=True)
    os._exit(0) if stop["now"] else sys.exit(1)
