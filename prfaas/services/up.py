"""``prfaas up``: a whole deployment on this machine, every role its own process on 127.0.0.1.

Start order: router, relay, prefill, decode. The router URL is printed once ``/health`` is 200. SIGINT/SIGTERM
stop the children in reverse order (SIGINT, which stops an instance without a drain, then SIGKILL after a grace
period); children also get SIGTERM from
the kernel if this process dies, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from prfaas.errors import InvalidRequest, PrfaasError
from prfaas.security import local

_PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 15.0


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
    startup_timeout_s: float = 600.0
    log_file: str | None = None  # children's output goes here instead of this terminal
    lab: bool = False  # place each role in its datacenter of the lab (`prfaas lab up` first)
    tls: bool = False  # mutual TLS 1.3 on every hop, certificates in a temporary directory (prfaas.security.local)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Deployment:
    def __init__(self, options: UpOptions) -> None:
        if options.mode not in ("relay", "direct"):
            raise InvalidRequest("--mode must be relay or direct")
        if options.prefill < 1 or options.decode < 1:
            raise InvalidRequest("--prefill and --decode must be at least 1")
        self.options = options
        self.children: list[subprocess.Popen[bytes]] = []
        self.tls_dir = tempfile.mkdtemp(prefix="prfaas-tls-") if options.tls else None
        self.tls_configs = local.tls_configs(self.tls_dir, options.config) if self.tls_dir else {}

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
        return ["--model", self.options.model, "--dtype", self.options.dtype]

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
        out = open(o.log_file, "ab") if o.log_file else None  # noqa: SIM115 (closed by the child's exit)
        self.children.append(subprocess.Popen(cmd, preexec_fn=_die_with_parent, stdout=out, stderr=out))
        if out:
            out.close()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            dead = [c for c in self.children if c.poll() is not None]
            if dead:
                role = " ".join(str(a) for a in list(dead[0].args)[3:6])  # type: ignore[arg-type]
                raise PrfaasError(f"a role exited during start-up: {role} (exit {dead[0].returncode})")
            with contextlib.suppress(httpx.HTTPError):
                verify = local.ca_client_context(self.tls_configs["ca"]) if self.tls_dir else True
                if httpx.get(f"{self.url}/health", timeout=2.0, verify=verify).status_code == 200:
                    return
            time.sleep(0.25)
        raise PrfaasError(f"the deployment was not healthy within {self.options.startup_timeout_s:.0f} s")

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.poll() is None:
                child.send_signal(signal.SIGINT)  # stop now: SIGTERM would drain each instance first
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=STOP_GRACE_S)
            if child.poll() is None:
                child.kill()
                child.wait()
        self.children.clear()
        if self.tls_dir:
            shutil.rmtree(self.tls_dir, ignore_errors=True)


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
        router, reported = deployment.children[0], set()
        while not stop["now"] and router.poll() is None:  # a dead instance is the router's to route around
            for child in deployment.children[1:]:
                if child.poll() is not None and child.pid not in reported:
                    reported.add(child.pid)
                    print(f"a role exited (pid {child.pid}, code {child.returncode}); the router routes around "
                          "it", flush=True)
            time.sleep(0.2)
    finally:
        deployment.stop()
        print("prfaas stopped: every process has exited", flush=True)
    os._exit(0) if stop["now"] else sys.exit(1)
